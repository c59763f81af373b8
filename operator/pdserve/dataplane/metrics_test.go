package main

import (
	"runtime"
	"testing"
	"time"
)

func TestObservationsLandInTheBucketOfTheirFirstBoundAtOrAbove(t *testing.T) {
	h := histograms{bounds: []float64{0.01, 0.1}}
	h.observe("r", 10*time.Millisecond) // le=0.01, as Prometheus counts it
	h.observe("r", 50*time.Millisecond)
	h.observe("r", time.Second) // past every bound: +Inf
	got := h.snapshot()
	if len(got) != 1 || got[0].Labels[0] != "r" {
		t.Fatalf("snapshot %+v", got)
	}
	if c := got[0].Counts; len(c) != 3 || c[0] != 1 || c[1] != 1 || c[2] != 1 {
		t.Fatalf("counts %v", c)
	}
	if sum := got[0].Sum; sum < 1.059 || sum > 1.061 {
		t.Fatalf("sum %g", sum)
	}
}

func TestLatencyBucketsMustBeAscendingPositiveSeconds(t *testing.T) {
	if bounds, err := parseBounds("latency-buckets", "0.005, 0.5,2"); err != nil || len(bounds) != 3 {
		t.Fatalf("%v %v", bounds, err)
	}
	for _, bad := range []string{"", "0.5,0.1", "0,1", "a"} {
		if _, err := parseBounds("latency-buckets", bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

var kept [][]byte

func TestTheRuntimeCountersReportWhatWasAllocatedAndCollected(t *testing.T) {
	before := runtimeStats()
	for name := range runtimeCounters {
		if _, ok := before[name]; !ok {
			t.Fatalf("runtime %q missing from %v", name, before)
		}
	}
	for i := 0; i < 1000; i++ {
		kept = append(kept, make([]byte, 1024))
	}
	kept = nil
	runtime.GC()
	after := runtimeStats()
	if grew := after["allocated_bytes"] - before["allocated_bytes"]; grew < 1000*1024 {
		t.Fatalf("allocated_bytes grew by %g after 1000 KiB were allocated", grew)
	}
	if after["allocated_objects"]-before["allocated_objects"] < 1000 {
		t.Fatalf("allocated_objects %g -> %g after 1000 allocations", before["allocated_objects"], after["allocated_objects"])
	}
	if after["gc_cycles"] <= before["gc_cycles"] {
		t.Fatalf("gc_cycles %g -> %g across runtime.GC()", before["gc_cycles"], after["gc_cycles"])
	}
}
