package main

import (
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
	if bounds, err := parseBounds("0.005, 0.5,2"); err != nil || len(bounds) != 3 {
		t.Fatalf("%v %v", bounds, err)
	}
	for _, bad := range []string{"", "0.5,0.1", "0,1", "a"} {
		if _, err := parseBounds(bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}
