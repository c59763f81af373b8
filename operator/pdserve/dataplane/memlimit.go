package main

// The heap's soft limit when none is given: a share of the container's memory limit. With
// GOGC at 400 the heap may grow to five times what is live before a collection; in a container
// that is killed at its limit (the Python gateway beside it in the same container), the
// collector must know where that limit is.

import (
	"os"
	"strconv"
	"strings"
)

// cgroupMemoryFiles: where a container's memory limit is read, cgroup v2 first, then v1.
var cgroupMemoryFiles = []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}

// containerMemoryLimit: the first of `files` that states a limit, in bytes; false when none
// does (not in a container, or no limit set).
func containerMemoryLimit(files []string) (int64, bool) {
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			continue
		}
		return parseMemoryLimit(string(text))
	}
	return 0, false
}

// parseMemoryLimit reads a cgroup memory limit file: cgroup v2 writes "max" for none, v1 a
// number near the largest page-aligned int64.
func parseMemoryLimit(text string) (int64, bool) {
	value, err := strconv.ParseInt(strings.TrimSpace(text), 10, 64)
	if err != nil || value <= 0 || value >= 1<<62 {
		return 0, false
	}
	return value, true
}

// heapLimit: the soft limit for the heap, `share` percent of the container's limit; 0 for
// none.
func heapLimit(files []string, share int64) int64 {
	limit, ok := containerMemoryLimit(files)
	if !ok || share <= 0 {
		return 0
	}
	return limit / 100 * share
}
