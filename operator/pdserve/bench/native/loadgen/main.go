// The gateway-overhead benchmark's load generator: POSTs one body to a URL, closed loop
// (-concurrency clients, each sending the next request when its answer is complete) or open
// loop (-rate requests a second, Poisson arrivals, however many in flight), for -seconds, and
// prints one JSON object: requests answered 200, errors, the wall time, and latency
// percentiles in milliseconds (the whole answer; for streams also the first event, and the
// events received).
//
//	loadgen -url http://127.0.0.1:8000/v1/chat/completions -body body.json -concurrency 32 -seconds 8
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"
)

type sample struct {
	total, first time.Duration
	events       int
	ok           bool
}

type result struct {
	Requests     int                `json:"requests"`
	Errors       int                `json:"errors"`
	FirstError   string             `json:"first_error,omitempty"`
	Seconds      float64            `json:"seconds"`
	LatencyMs    map[string]float64 `json:"latency_ms"`
	FirstEventMs map[string]float64 `json:"first_event_ms,omitempty"`
	Events       int                `json:"events"`
}

func percentiles(values []time.Duration) map[string]float64 {
	if len(values) == 0 {
		return nil
	}
	slices.Sort(values)
	at := func(q float64) float64 {
		index := int(q * float64(len(values)-1))
		return float64(values[index].Microseconds()) / 1000
	}
	return map[string]float64{"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": at(1)}
}

func send(client *http.Client, url string, body []byte, stream bool) (sample, string) {
	begun := time.Now()
	response, err := client.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return sample{}, err.Error()
	}
	defer response.Body.Close()
	if response.StatusCode != http.StatusOK {
		text, _ := io.ReadAll(response.Body)
		return sample{}, fmt.Sprintf("HTTP %d: %.200s", response.StatusCode, text)
	}
	got := sample{ok: true}
	if !stream {
		if _, err := io.Copy(io.Discard, response.Body); err != nil {
			return sample{}, err.Error()
		}
		got.total = time.Since(begun)
		got.first = got.total
		return got, ""
	}
	lines := bufio.NewReaderSize(response.Body, 64*1024)
	for {
		line, err := lines.ReadSlice('\n')
		if bytes.HasPrefix(line, []byte("data: ")) {
			if got.events == 0 {
				got.first = time.Since(begun)
			}
			got.events++
		}
		if err == io.EOF {
			break
		}
		if err != nil && err != bufio.ErrBufferFull {
			return sample{}, err.Error()
		}
	}
	got.total = time.Since(begun)
	return got, ""
}

func main() {
	url := flag.String("url", "", "where to POST")
	bodyPath := flag.String("body", "", "file holding the JSON body")
	concurrency := flag.Int("concurrency", 1, "closed loop: clients (ignored with -rate)")
	rate := flag.Float64("rate", 0, "open loop: requests a second, Poisson arrivals")
	seconds := flag.Float64("seconds", 5, "how long to send")
	stream := flag.Bool("stream", false, "the body asks for a stream: count its events")
	maxConns := flag.Int("max-conns", 0, "connections to the target at most, as a client's pool bounds them; requests beyond wait for one, the wait counted in their latency (0: no bound)")
	flag.Parse()
	body, err := os.ReadFile(*bodyPath)
	if err != nil || *url == "" {
		fmt.Fprintln(os.Stderr, "loadgen: -url and a readable -body are required:", err)
		os.Exit(2)
	}
	// Unbounded, an open loop opens a connection for every request sent while none is idle: a
	// pause of a few milliseconds turns into thousands of new connections (docs/benchmarks.md).
	transport := &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096,
		MaxConnsPerHost: *maxConns, DisableCompression: true}
	client := &http.Client{Transport: transport, Timeout: 120 * time.Second}
	var mu sync.Mutex
	var samples []sample
	errors, firstError := 0, ""
	record := func(s sample, problem string) {
		mu.Lock()
		defer mu.Unlock()
		if problem != "" {
			errors++
			if firstError == "" {
				firstError = problem
			}
			return
		}
		samples = append(samples, s)
	}
	stopAt := time.Now().Add(time.Duration(*seconds * float64(time.Second)))
	begun := time.Now()
	var wg sync.WaitGroup
	if *rate > 0 {
		next := time.Now()
		for next.Before(stopAt) {
			time.Sleep(time.Until(next))
			wg.Add(1)
			go func() {
				defer wg.Done()
				record(send(client, *url, body, *stream))
			}()
			next = next.Add(time.Duration(rand.ExpFloat64() / *rate * float64(time.Second)))
		}
	} else {
		for range *concurrency {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stopAt) {
					record(send(client, *url, body, *stream))
				}
			}()
		}
	}
	wg.Wait()
	out := result{Requests: len(samples), Errors: errors, FirstError: firstError,
		Seconds: time.Since(begun).Seconds()}
	totals := make([]time.Duration, 0, len(samples))
	firsts := make([]time.Duration, 0, len(samples))
	for _, s := range samples {
		totals = append(totals, s.total)
		firsts = append(firsts, s.first)
		out.Events += s.events
	}
	out.LatencyMs = percentiles(totals)
	if *stream {
		out.FirstEventMs = percentiles(firsts)
	}
	_ = json.NewEncoder(os.Stdout).Encode(out)
}
