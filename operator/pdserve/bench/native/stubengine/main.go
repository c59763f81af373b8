// A stub vLLM engine for the gateway-overhead benchmark: it speaks the OpenAI routes and the
// NixlConnector handoff fields a P/D proxy relies on, and answers in microseconds, so what a
// benchmark measures is the proxy in front of it, not the engine.
//
//	stubengine -port 8100 -role prefill|decode|both -model NAME
//
// A request with kv_transfer_params.do_remote_decode (P/D step 1) answers one token and the
// params decode pulls from; any other request answers max_tokens tokens ("tok "), streamed
// as one event per token when asked, with the include_usage trailer and [DONE].
//
// It also speaks the render route's APIs (tokens.go): render (a prompt of N bytes is N/4
// token ids), the tokens engines' /inference/v1/generate and derender, streamed or not.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

type request struct {
	Stream        bool           `json:"stream"`
	MaxTokens     *int           `json:"max_tokens"`
	MaxCompletion *int           `json:"max_completion_tokens"`
	KVParams      map[string]any `json:"kv_transfer_params"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

type engine struct {
	model   string
	role    string
	served  atomic.Int64
	running atomic.Int64
}

func (e *engine) tokens(r *request) int {
	switch {
	case r.MaxCompletion != nil:
		return *r.MaxCompletion
	case r.MaxTokens != nil:
		return *r.MaxTokens
	default:
		return 16
	}
}

func (e *engine) completion(w http.ResponseWriter, req *http.Request, chat bool) {
	e.running.Add(1)
	defer e.running.Add(-1)
	var body request
	length := req.ContentLength
	if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `{"error":{"message":%q,"type":"BadRequestError","code":400}}`, err.Error())
		return
	}
	e.served.Add(1)
	prompt := int(length / 4)
	n := e.tokens(&body)
	var kv map[string]any
	if body.KVParams != nil {
		if remote, _ := body.KVParams["do_remote_decode"].(bool); remote {
			n = 1
			kv = map[string]any{
				"do_remote_prefill": true, "do_remote_decode": false,
				"remote_engine_id": "stub-" + e.role, "remote_block_ids": []int{1, 2, 3},
				"remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
			}
		}
	}
	id := fmt.Sprintf("cmpl-%d", e.served.Load())
	object, delta := "text_completion", "text"
	if chat {
		object = "chat.completion"
	}
	created := time.Now().Unix()
	usage := map[string]int{"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
	if !body.Stream {
		choice := map[string]any{"index": 0, "finish_reason": "length", "logprobs": nil}
		text := strings.Repeat("tok ", n)
		if chat {
			choice["message"] = map[string]any{"role": "assistant", "content": text}
		} else {
			choice[delta] = text
		}
		answer := map[string]any{
			"id": id, "object": object, "created": created, "model": e.model,
			"choices": []any{choice}, "usage": usage,
		}
		if kv != nil {
			answer["kv_transfer_params"] = kv
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(answer)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	flusher, _ := w.(http.Flusher)
	if chat {
		object = "chat.completion.chunk"
	}
	for i := 0; i < n; i++ {
		choice := map[string]any{"index": 0, "finish_reason": nil}
		if i == n-1 {
			choice["finish_reason"] = "length"
		}
		if chat {
			choice["delta"] = map[string]any{"content": "tok "}
		} else {
			choice[delta] = "tok "
		}
		event, _ := json.Marshal(map[string]any{
			"id": id, "object": object, "created": created, "model": e.model,
			"choices": []any{choice},
		})
		if _, err := fmt.Fprintf(w, "data: %s\n\n", event); err != nil {
			return // the client left
		}
		if flusher != nil {
			flusher.Flush()
		}
	}
	if body.StreamOptions != nil && body.StreamOptions.IncludeUsage {
		event, _ := json.Marshal(map[string]any{
			"id": id, "object": object, "created": created, "model": e.model,
			"choices": []any{}, "usage": usage,
		})
		fmt.Fprintf(w, "data: %s\n\n", event)
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func (e *engine) metrics(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	fmt.Fprintf(w, "vllm:num_requests_running{model_name=%q} %d\n", e.model, e.running.Load())
	fmt.Fprintf(w, "vllm:num_requests_waiting{model_name=%q} 0\n", e.model)
	fmt.Fprintf(w, "vllm:kv_cache_usage_perc{model_name=%q} 0\n", e.model)
	fmt.Fprintf(w, "vllm:request_success_total{model_name=%q} %d\n", e.model, e.served.Load())
}

func main() {
	port := flag.Int("port", 8100, "port to listen on (127.0.0.1)")
	role := flag.String("role", "both", "prefill, decode or both (named in kv_transfer_params)")
	model := flag.String("model", "qwen", "the served model name")
	flag.Parse()
	e := &engine{model: *model, role: *role}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		e.completion(w, r, true)
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		e.completion(w, r, false)
	})
	e.tokensRoutes(mux)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /metrics", e.metrics)
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"stub","max_model_len":131072}]}`, e.model)
	})
	server := &http.Server{Addr: fmt.Sprintf("127.0.0.1:%d", *port), Handler: mux}
	log.Fatal(server.ListenAndServe())
}
