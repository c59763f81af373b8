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
// after it, whatever is left of the request body unread.
func answerError(w http.ResponseWriter, status int, kind, message string, closing bool) {
	header := w.Header()
	header.Set("Content-Type", "application/json")
	if closing {
		header.Set("Connection", "close")
	}
	if status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable {
		header.Set("Retry-After", "1")
	}
	body := errorBody(status, kind, message, "")
	header.Set("Content-Length", strconv.Itoa(len(body))) // flushed early, still not chunked
	w.WriteHeader(status)
	_, _ = w.Write(body)
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

func unauthorized(w http.ResponseWriter, r *http.Request) {
	refuseBeforeBody(w, r, http.StatusUnauthorized, "AuthenticationError",
		"missing or invalid API key: send Authorization: Bearer <key>")
}

// refuseBeforeBody answers a request refused before its body is read. The body is then read
// only to be dropped, and only while it keeps coming (as aiohttp's lingering close does for the
// Python gateway): most clients send their whole body before they read the answer, and closing
// the connection on bytes not read would reset it, the answer lost with it. A client that
// stalls is cut off after lingerIdle.
func refuseBeforeBody(w http.ResponseWriter, r *http.Request, status int, kind, message string) {
	answerError(w, status, kind, message, true)
	control := http.NewResponseController(w)
	_ = control.Flush() // the answer first: the client may read it while it still sends
	end := time.Now().Add(lingerFor)
	var scratch [16 * 1024]byte
	for now := time.Now(); now.Before(end); now = time.Now() {
		if control.SetReadDeadline(now.Add(min(lingerIdle, end.Sub(now)))) != nil {
			break
		}
		if _, err := r.Body.Read(scratch[:]); err != nil {
			break
		}
	}
	unread(control)
}

// How long an unauthorized request's body is dropped as it arrives (aiohttp's lingering_time),
// and how long a pause in it ends that.
const (
	lingerFor  = 10 * time.Second
	lingerIdle = time.Second
)

// unread: Go's server does not wait for what is left of the request body before it closes the
// connection (it would read up to 256 KiB of it to keep the connection).
func unread(control *http.ResponseController) {
	_ = control.SetReadDeadline(longAgo)
}

func bodyTimedOut(w http.ResponseWriter, limit time.Duration) {
	answerError(w, http.StatusRequestTimeout, "RequestTimeout",
		"the request body did not arrive within "+pySeconds(limit)+" s", true)
	unread(http.NewResponseController(w)) // the client stalled: nothing to wait for
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

// stages: the fast path's fallbacks that waited on something, and what it waited on, named as
// the Python gateway names them to clients (an engine's address as "a replica").
var stages = map[fallback]string{"prefill_failed": "prefill at a replica",
	"decode_failed": "decode at a replica", "render_failed": "render at a replica",
	"derender_failed": "derender at a replica", "admission_failed": "prefill admission"}
