// Package shard spreads keys over [Count] shards and shards over workers.
//
// A key's shard is a stable hash of the key, so every process computes the
// same one (nodes.shard stores it for node keys). Workers divide shards by
// rendezvous (highest random weight) hashing: each shard goes to the live
// worker with the highest score for the pair, so when a worker joins or leaves
// only the shards it wins or held move, about 1/n of them.
package shard

import (
	"hash/fnv"
	"slices"
)

// Count is the number of shards.
const Count = 256

// Of returns the shard of key, in [0, Count).
func Of(key string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(mix32(h.Sum32()) % Count)
}

// score is the rendezvous weight of (worker, item).
func score(worker, item string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(worker))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(item))
	return mix64(h.Sum64())
}

// Owner returns the worker that wins item (a shard name such as "shard:17",
// or a singleton lease name) among workers, or "" when there are none. Ties
// break by worker id so every process agrees.
func Owner(item string, workers []string) string {
	best, bestScore := "", uint64(0)
	for _, w := range workers {
		s := score(w, item)
		if best == "" || s > bestScore || (s == bestScore && w < best) {
			best, bestScore = w, s
		}
	}
	return best
}

// Assign returns the shards, in order, that worker wins among workers, given
// each shard's item name.
func Assign(worker string, workers []string, name func(shard int) string) []int {
	if !slices.Contains(workers, worker) {
		return nil
	}
	var out []int
	for s := range Count {
		if Owner(name(s), workers) == worker {
			out = append(out, s)
		}
	}
	return out
}

// mix64 is splitmix64's finaliser: it spreads FNV's weak low bits.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func mix32(x uint32) uint32 {
	x ^= x >> 16
	x *= 0x7feb352d
	x ^= x >> 15
	x *= 0x846ca68b
	x ^= x >> 16
	return x
}
