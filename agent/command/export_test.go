package command

// TailLogs exposes tailLogs to the tests.
var TailLogs = tailLogs
