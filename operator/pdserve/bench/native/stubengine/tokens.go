package main

// The render route's APIs in vLLM's shapes (render, a tokens engine's generate, derender),
// with canned content: what the benchmark measures is the gateway driving render -> prefill
// -> decode -> derender, not these.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

type generateRequest struct {
	Stream         bool `json:"stream"`
	SamplingParams struct {
		MaxTokens *int `json:"max_tokens"`
	} `json:"sampling_params"`
	KVParams map[string]any `json:"kv_transfer_params"`
}

type derenderRequest struct {
	Stream           bool        `json:"stream"`
	Model            string      `json:"model"`
	GenerateResponse *generated  `json:"generate_response"`
	Responses        []generated `json:"generate_responses"`
	Chunk            *generated  `json:"generate_chunk"`
	StreamState      *struct {
		Sent int `json:"sent"`
	} `json:"stream_state"`
}

type generated struct {
	RequestID string `json:"request_id"`
	Choices   []struct {
		Index        int     `json:"index"`
		TokenIDs     []int   `json:"token_ids"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
}

func (e *engine) tokensRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/chat/completions/render", func(w http.ResponseWriter, r *http.Request) {
		e.render(w, r, true)
	})
	mux.HandleFunc("POST /v1/completions/render", func(w http.ResponseWriter, r *http.Request) {
		e.render(w, r, false)
	})
	mux.HandleFunc("POST /inference/v1/generate", e.generate)
	mux.HandleFunc("POST /v1/chat/completions/derender", func(w http.ResponseWriter, r *http.Request) {
		e.derender(w, r, true)
	})
	mux.HandleFunc("POST /v1/completions/derender", func(w http.ResponseWriter, r *http.Request) {
		e.derender(w, r, false)
	})
}

func ids(n int) string {
	if n < 1 {
		n = 1
	}
	return "[" + strings.Repeat("7,", n-1) + "7]"
}

func badRequest(w http.ResponseWriter, err error) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadRequest)
	fmt.Fprintf(w, `{"error":{"message":%q,"type":"BadRequestError","code":400}}`, err.Error())
}

// render: the prompt's bytes / 4 token ids, the request's max_tokens resolved.
func (e *engine) render(w http.ResponseWriter, r *http.Request, chat bool) {
	raw, err := io.ReadAll(r.Body)
	var body request
	if err == nil {
		err = json.Unmarshal(raw, &body)
	}
	if err != nil {
		badRequest(w, err)
		return
	}
	e.served.Add(1)
	generate := fmt.Sprintf(`{"request_id":"chatcmpl-%d","token_ids":%s,"features":null,`+
		`"sampling_params":{"max_tokens":%d,"n":1,"temperature":1.0,"extra_args":null},`+
		`"model":%q,"stream":%t,"stream_options":null,"cache_salt":null,"priority":0,`+
		`"kv_transfer_params":null}`, e.served.Load(), ids(len(raw)/4), e.tokens(&body), e.model, body.Stream)
	if !chat {
		generate = "[" + generate + "]"
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, generate)
}

// generate: a tokens engine's answer, one token with the handoff's params on P/D step 1.
func (e *engine) generate(w http.ResponseWriter, r *http.Request) {
	e.running.Add(1)
	defer e.running.Add(-1)
	var body generateRequest
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		badRequest(w, err)
		return
	}
	e.served.Add(1)
	n := 16
	if body.SamplingParams.MaxTokens != nil {
		n = *body.SamplingParams.MaxTokens
	}
	kv := "null"
	if remote, _ := body.KVParams["do_remote_decode"].(bool); remote {
		n = 1
		kv = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"stub-` + e.role +
			`","remote_block_ids":[1,2,3],"remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}`
	}
	id := fmt.Sprintf("generate-tokens-%d", e.served.Load())
	if !body.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"request_id":%q,"model":%q,"created":%d,"choices":[{"index":0,"token_ids":%s,`+
			`"finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":1,"completion_tokens":%d,`+
			`"total_tokens":%d},"kv_transfer_params":%s,"prompt_logprobs":null}`,
			id, e.model, time.Now().Unix(), ids(n), n, n+1, kv)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	flusher, _ := w.(http.Flusher)
	for i := 0; i < n; i++ {
		finish := "null"
		if i == n-1 {
			finish = `"length"`
		}
		if _, err := fmt.Fprintf(w, "data: {\"request_id\":%q,\"choices\":[{\"index\":0,\"token_ids\":[7],\"finish_reason\":%s,\"logprobs\":null}]}\n\n", id, finish); err != nil {
			return // the client left
		}
		if flusher != nil {
			flusher.Flush()
		}
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

// derender: "tok " per token id, a whole answer or one stream chunk.
func (e *engine) derender(w http.ResponseWriter, r *http.Request, chat bool) {
	var body derenderRequest
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		badRequest(w, err)
		return
	}
	e.served.Add(1)
	w.Header().Set("Content-Type", "application/json")
	created := time.Now().Unix()
	if body.Stream && body.Chunk != nil && len(body.Chunk.Choices) == 1 {
		choice := body.Chunk.Choices[0]
		sent := 0
		if body.StreamState != nil {
			sent = body.StreamState.Sent
		}
		finish, _ := json.Marshal(choice.FinishReason)
		text := strings.Repeat("tok ", len(choice.TokenIDs))
		part := fmt.Sprintf(`{"index":%d,"text":%q,"finish_reason":%s,"logprobs":null}`, choice.Index, text, finish)
		object := "text_completion"
		if chat {
			object = "chat.completion.chunk"
			role := ""
			if sent == 0 {
				role = `"role":"assistant",`
			}
			part = fmt.Sprintf(`{"index":%d,"delta":{%s"content":%q},"finish_reason":%s,"logprobs":null}`,
				choice.Index, role, text, finish)
		}
		fmt.Fprintf(w, `{"chunk":{"id":%q,"object":%q,"created":%d,"model":%q,"choices":[%s]},"stream_state":{"sent":%d}}`,
			body.Chunk.RequestID, object, created, body.Model, part, sent+len(choice.TokenIDs))
		return
	}
	answer := body.GenerateResponse
	if !chat && len(body.Responses) == 1 {
		answer = &body.Responses[0]
	}
	if answer == nil || len(answer.Choices) == 0 {
		badRequest(w, fmt.Errorf("nothing to derender"))
		return
	}
	parts := []string{}
	n := 0
	for _, choice := range answer.Choices {
		text := strings.Repeat("tok ", len(choice.TokenIDs))
		n += len(choice.TokenIDs)
		finish, _ := json.Marshal(choice.FinishReason)
		if chat {
			parts = append(parts, fmt.Sprintf(`{"index":%d,"message":{"role":"assistant","content":%q,"tool_calls":[]},"finish_reason":%s,"logprobs":null}`,
				choice.Index, text, finish))
		} else {
			parts = append(parts, fmt.Sprintf(`{"index":%d,"text":%q,"finish_reason":%s,"logprobs":null}`, choice.Index, text, finish))
		}
	}
	object := "text_completion"
	if chat {
		object = "chat.completion"
	}
	fmt.Fprintf(w, `{"id":%q,"object":%q,"created":%d,"model":%q,"choices":[%s],"usage":{"prompt_tokens":1,"completion_tokens":%d,"total_tokens":%d}}`,
		answer.RequestID, object, created, body.Model, strings.Join(parts, ","), n, n+1)
}
