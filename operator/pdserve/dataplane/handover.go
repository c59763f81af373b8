package main

// The data plane's own answers, in the Python gateway's words (gateway/errors.py error_body: the
// same status, message, type and Retry-After, whichever path a client's request took), and the
// hand-over of a request to the Python gateway.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"time"
)

// A completion handed over after the data plane spent time on it carries that time, so the
// Python gateway's request timeout runs from the client's first byte, not from the hand-over
// (else a request whose fast path used up its deadline would get a whole new one, and the
// engines do its work twice). Only the data plane sets these: the Python gateway honours the
// elapsed time only beside the token it started the data plane with (gateway/dataplane.py).
const (
	elapsedHeader = "X-PDServe-Elapsed-Ms"
	tokenHeader   = "X-PDServe-Dataplane-Token"
)

// handedOver is the request context's key for when the data plane began a completion it hands
// over.
type handedOver struct{}

// pythonProxy passes requests to the Python gateway at target as a reverse proxy would, the
// client's Host and X-Forwarded-For (with the client's address added) kept; client-sent copies
// of the hand-over headers are dropped from every request, and the data plane's own set on
// the completions it hands over.
func pythonProxy(target *url.URL, token string, transport http.RoundTripper) *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		// Rewrite, not Director: hop-by-hop headers are removed before it runs, so a client
		// naming the hand-over headers in its Connection header cannot strip the data plane's.
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = pr.In.Host
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			pr.SetXForwarded()
			pr.Out.Header.Del(elapsedHeader)
			pr.Out.Header.Del(tokenHeader)
			if started, ok := pr.In.Context().Value(handedOver{}).(time.Time); ok && token != "" {
				elapsed := time.Since(started).Milliseconds()
				pr.Out.Header.Set(elapsedHeader, strconv.FormatInt(elapsed, 10))
				pr.Out.Header.Set(tokenHeader, token)
			}
		},
		Transport:     transport,
		FlushInterval: -1, // streams pass through event by event
		ErrorHandler:  pythonUnavailable,
	}
}

// withHandOverStart marks a completion the data plane began at `started` for the hand-over.
func withHandOverStart(r *http.Request, started time.Time) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), handedOver{}, started))
}

// answerError writes an error in the Python gateway's shape. `closing`: the connection closes
// after it, the rest of the request body unread: an unauthorized or stalled upload costs
// nothing more (Go's server would otherwise wait to discard what is left of it first).
func answerError(w http.ResponseWriter, status int, kind, message string, closing bool) {
	header := w.Header()
	header.Set("Content-Type", "application/json")
	if closing {
		header.Set("Connection", "close")
		_ = http.NewResponseController(w).SetReadDeadline(longAgo)
	}
	if status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable {
		header.Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"error":{"message":%s,"type":%q,"param":null,"code":%d}}`, quoted(message), kind, status)
}

// quoted is a JSON string as the Python gateway's encoder writes it (<, > and & as they are).
func quoted(text string) []byte {
	var out bytes.Buffer
	encoder := json.NewEncoder(&out)
	encoder.SetEscapeHTML(false)
	_ = encoder.Encode(text)
	return bytes.TrimSuffix(out.Bytes(), []byte("\n"))
}

// pySeconds formats seconds as Python's f"{seconds:g}" does.
func pySeconds(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'g', 6, 64)
}

func unauthorized(w http.ResponseWriter) {
	answerError(w, http.StatusUnauthorized, "AuthenticationError",
		"missing or invalid API key: send Authorization: Bearer <key>", true)
}

func bodyTimedOut(w http.ResponseWriter, limit time.Duration) {
	answerError(w, http.StatusRequestTimeout, "RequestTimeout",
		"the request body did not arrive within "+pySeconds(limit)+" s", true)
}

func atLimit(w http.ResponseWriter, limit int64) {
	answerError(w, http.StatusTooManyRequests, "RateLimitError", fmt.Sprintf(
		"the gateway is at its limit of %d requests in flight; retry shortly", limit), false)
}

// pastDeadline answers a request whose fast path ran out of the request timeout while waiting
// on `stage`, as the Python gateway's UpstreamClient.past_deadline does.
func pastDeadline(w http.ResponseWriter, stage string, limit time.Duration) {
	answerError(w, http.StatusGatewayTimeout, "GatewayTimeout",
		stage+" did not answer within the request's limit of "+pySeconds(limit)+" s", false)
}

// stages: the fast path's fallbacks that waited on something, and what it waited on.
var stages = map[fallback]string{"prefill_failed": "prefill", "decode_failed": "decode",
	"render_failed": "render", "derender_failed": "derender",
	"admission_failed": "prefill admission"}
