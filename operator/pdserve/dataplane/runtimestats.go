package main

// The data plane's own Go runtime, in /stats `runtime`: what it allocated and what its garbage
// collector cost, cumulative since start. The Python gateway adds them to its /metrics
// (pdserve_gateway_dataplane_*), so an operator reading a tail latency can tell the collector's
// share from the engines'.

import "runtime/metrics"

// runtimeCounters are the runtime/metrics samples reported, by the name /stats gives each.
var runtimeCounters = map[string]string{
	"allocated_bytes":   "/gc/heap/allocs:bytes",
	"allocated_objects": "/gc/heap/allocs:objects",
	"gc_cycles":         "/gc/cycles/total:gc-cycles",
	"gc_cpu_seconds":    "/cpu/classes/gc/total:cpu-seconds",
}

func runtimeStats() map[string]float64 {
	samples := make([]metrics.Sample, 0, len(runtimeCounters))
	names := make([]string, 0, len(runtimeCounters))
	for name, metric := range runtimeCounters {
		samples = append(samples, metrics.Sample{Name: metric})
		names = append(names, name)
	}
	metrics.Read(samples)
	out := make(map[string]float64, len(samples))
	for i, sample := range samples {
		switch sample.Value.Kind() {
		case metrics.KindUint64:
			out[names[i]] = float64(sample.Value.Uint64())
		case metrics.KindFloat64:
			out[names[i]] = sample.Value.Float64()
		} // KindBad: a runtime without it; left out rather than reported as 0
	}
	return out
}
