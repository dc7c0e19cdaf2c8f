package capacity

// FreeCountsFor exposes freeCounts to the tests.
var FreeCountsFor = freeCounts
