module github.com/bettercompute/bettercompute/agent

go 1.26.0

replace github.com/bettercompute/bettercompute/proto => ../proto
