package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// The fast path's cost per request, engine calls on loopback included: what a change to it
// adds shows here (allocations above all: go test -bench Serving -benchmem).
func benchServing(b *testing.B, table, body string, engine http.HandlerFunc) {
	server := httptest.NewServer(engine)
	b.Cleanup(server.Close)
	p := &plane{upstream: newUpstreamPool(time.Second, 10*time.Second, time.Minute),
		maxBody: 1 << 20, maxInflight: 1 << 20, engines: map[string]*endpoint{},
		queue: newFairQueue(), metrics: newServedMetrics([]float64{0.01, 1}, []float64{1, 2, 4})}
	p.timeouts.idle, p.timeouts.request, p.timeouts.body = 5*time.Second, 10*time.Second, 10*time.Second
	p.buffers.New = func() any { return new(bytes.Buffer) }
	p.chunks.New = func() any { chunk := make([]byte, 32*1024); return &chunk }
	built, engines, err := build([]byte(strings.ReplaceAll(table, "URL", server.URL)), nil)
	if err != nil {
		b.Fatal(err)
	}
	p.engines = engines
	p.current.Store(built)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		recorder := httptest.NewRecorder()
		p.serveCompletion(recorder, httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)))
		if recorder.Code != 200 {
			b.Fatalf("%d %s", recorder.Code, recorder.Body.String())
		}
	}
}

const benchBody = `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}`

func BenchmarkServingAPDAnswer(b *testing.B) {
	benchServing(b, `{"version":1,"models":{"m":{"route":"pd","groups":[{"prefill":["URL"],"decode":["URL"]}]}}}`,
		benchBody, func(w http.ResponseWriter, r *http.Request) {
			raw, _ := io.ReadAll(r.Body)
			if bytes.Contains(raw, []byte(`"do_remote_decode"`)) {
				io.WriteString(w, `{"choices":[{"index":0}],"kv_transfer_params":{"remote_engine_id":"e"}}`)
				return
			}
			io.WriteString(w, `{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}`)
		})
}

func BenchmarkServingADecodeStream(b *testing.B) {
	benchServing(b, `{"version":1,"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["URL"]}]}}}`,
		strings.Replace(benchBody, `"max_tokens":8`, `"max_tokens":8,"stream":true`, 1),
		func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "text/event-stream")
			for i := range 8 {
				finish := "null"
				if i == 7 {
					finish = `"length"`
				}
				io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"content":"t"},"finish_reason":`+finish+"}]}\n\n")
				w.(http.Flusher).Flush()
			}
			io.WriteString(w, "data: [DONE]\n\n")
		})
}
