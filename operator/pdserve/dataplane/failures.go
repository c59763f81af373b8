package main

// Failures after engine work began, answered here as the Python gateway answers them
// (gateway/upstream.py post_json, hops.py, errors.py client_error): handed over, the request
// would start again, the engines would do its work twice, and a fault the first try met would
// be gone, the client told something else than the Python gateway would tell it.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// failure is how a call (or the calls of a stage, across its replicas) failed.
type failure struct {
	status   int    // what the client gets: 502, 504, or the engine's own 4xx
	kind     string // the error's type
	param    string // "" answers "param": null
	message  string // as the Python gateway words it, addresses still in (scrubbed when answered)
	timedOut bool
	// final: the Python gateway's GatewayError (a 4xx the engine answered, the request's
	// deadline passed, an answer of the wrong shape): answered as it is. Otherwise its
	// UpstreamFailed: another replica, or local prefill, may still serve the request.
	final bool
	kv    bool // an engine could not load prefill's KV ("KV transfer" in its error)
	// answered: the engine's own error message, when it answered one
	answered string
}

func (f *failure) Error() string { return f.message }

func upstreamFailed(message string, timedOut bool) *failure {
	status, kind := http.StatusBadGateway, "UpstreamError"
	if timedOut {
		status = http.StatusGatewayTimeout
	}
	return &failure{status: status, kind: kind, message: message, timedOut: timedOut,
		kv: strings.Contains(message, "KV transfer")}
}

func gatewayError(status int, kind, message string) *failure {
	return &failure{status: status, kind: kind, message: message, final: true}
}

// pastDeadlineFailure is UpstreamClient.past_deadline: `at` may be nil (no replica named).
func (p *plane) pastDeadlineFailure(stage string, at *endpoint) *failure {
	where := ""
	if at != nil {
		where = " at " + at.url
	}
	return gatewayError(http.StatusGatewayTimeout, "GatewayTimeout", stage+where+
		" did not answer within the request's limit of "+pySeconds(p.timeouts.request)+" s")
}

// clientMessage is what the client reads of a failure: a 5xx without the cluster's addresses.
func (f *failure) clientMessage() string {
	if f.status >= 500 {
		return withoutAddresses(f.message)
	}
	return f.message
}

func (f *failure) body() []byte {
	return errorBody(f.status, f.kind, f.clientMessage(), f.param)
}

// errorBody is every error answer's body, the Python gateway's errors.error_body as its wire
// codec writes it (param "" is null): the cases in testdata/error_bodies.json hold both sides
// to the same bytes.
func errorBody(status int, kind, message, param string) []byte {
	paramJSON := []byte("null")
	if param != "" {
		paramJSON = quoted(param)
	}
	return fmt.Appendf(nil, `{"error":{"message":%s,"type":%s,"param":%s,"code":%d}}`,
		quoted(message), quoted(kind), paramJSON, status)
}

// answerFailure ends a request whose answer has not begun with its failure, counted by s.
func answerFailure(w http.ResponseWriter, s *served, f *failure) {
	s.outcome = "error_" + strconv.Itoa(f.status)
	if f.status >= 500 {
		// The addresses the client is not told stay in the gateway's log, as the Python
		// gateway keeps them (app.py _log_failure); a client's own mistakes are not logged.
		id := s.id
		if id == "" {
			id = "-"
		}
		log.Printf("pdserve-dataplane: %s: answered %d: %s", id, f.status, f.message)
	}
	header := w.Header()
	if s.id != "" {
		nameAnswer(header, s.id, s.clientID)
	}
	if s.log != nil {
		s.log.failed = true
	}
	body := f.body()
	header.Set("Content-Type", "application/json")
	header.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(f.status)
	_, _ = w.Write(body)
}

// upstreamMessage is errors.upstream_message: the message inside an engine's error answer,
// never the answer's own bytes (they may be another request's).
func upstreamMessage(payload []byte) string {
	var body any
	if err := json.Unmarshal(payload, &body); err != nil {
		return fmt.Sprintf("an error answer that is not JSON (%d bytes)", len(payload))
	}
	if object, ok := body.(map[string]any); ok {
		if inner, ok := object["error"].(map[string]any); ok {
			if message, ok := inner["message"].(string); ok {
				return message
			}
		}
		if message, ok := object["message"].(string); ok {
			return message
		}
	}
	return "an error answer without a message"
}

// callFailure names what broke a call as errors.upstream_failure names aiohttp's errors.
func callFailure(err error) string {
	var dial *net.OpError
	var handshake *handshakeError
	if errors.As(err, &handshake) && !timedOut(err) {
		return handshake.words()
	}
	if errors.As(err, &dial) && dial.Op == "dial" {
		if errors.Is(err, syscall.ECONNREFUSED) {
			host, port, _ := net.SplitHostPort(dial.Addr.String())
			return fmt.Sprintf("ClientConnectorError: Connect call failed ('%s', %s)", host, port)
		}
		var errno syscall.Errno
		if errors.As(err, &errno) {
			return "ClientConnectorError: " + errno.Error()
		}
		return "ClientConnectorError: cannot connect"
	}
	if errors.Is(err, errMalformedAnswer) {
		return "ClientResponseError: the answer's HTTP framing is malformed"
	}
	return "ServerDisconnectedError"
}

// outOfTime names a call that ran out of time (errors.out_of_time) by what never came: the
// connection, within the connect timeout, or the answer, within `waited`.
func (p *plane) outOfTime(stage, url string, err error, waited time.Duration) string {
	return outOfTimeWords(stage, url, dialTimedOut(err), waited, p.upstream.dialer.Timeout)
}

func outOfTimeWords(stage, url string, dialing bool, waited, connect time.Duration) string {
	if dialing {
		return stage + " at " + url + ": could not connect within " + pySeconds(connect) + " s"
	}
	return stage + " at " + url + ": no answer within " + pySeconds(waited) + " s"
}

// dialTimedOut: the connection was not made in time (a dial's own timeout).
func dialTimedOut(err error) bool {
	var dial *net.OpError
	return errors.As(err, &dial) && dial.Op == "dial" && timedOut(err)
}

// timedOut: the call's own bound passed (not the client leaving).
func timedOut(err error) bool {
	var netErr net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &netErr) && netErr.Timeout())
}

// callJSON is post_json: one POST to the first of `candidates` that answers, each tried once;
// on a connection error, a timeout, a 5xx or a 200 that is not JSON the next one is tried.
// `limit` bounds each call whole (its answer read to the end); `deadline` (the request's, for
// prefill and decode) ends the tries with a 504. `prefills` prompt tokens are counted on each
// engine tried until it answered (its load). The answer is read into `into`.
func (p *plane) callJSON(ctx context.Context, stage string, candidates []*endpoint, path string,
	body []byte, id, auth string, limit time.Duration, deadline bool, prefills int64,
	into *bytes.Buffer) (*endpoint, *failure) {
	var last *failure
	for _, e := range candidates {
		started := time.Now()
		until := started.Add(limit)
		if at, ok := ctx.Deadline(); ok && deadline && at.Before(until) {
			until = at
		}
		if !until.After(started) {
			return nil, p.pastDeadlineFailure(stage, nil)
		}
		prefilled := e.owe(prefills)
		err := p.callWithin(ctx, e, path, body, id, auth, until, into)
		prefilled()
		if stage == "render" || stage == "derender" {
			spent := time.Since(started)
			p.metrics.render.observe(e.url+"\t"+stage, spent)
			if err == nil {
				p.metrics.stage.observe(stage, spent)
			}
		}
		if err == nil {
			return e, nil
		}
		if f := p.ended(ctx, stage, e, deadline); f != nil {
			return nil, f
		}
		var answered *answerStatus
		switch {
		case errors.As(err, &answered) && answered.status < 500:
			return nil, gatewayError(answered.status, "UpstreamError", upstreamMessage(into.Bytes()))
		case errors.As(err, &answered):
			last = upstreamFailed(fmt.Sprintf("%s at %s: HTTP %d: %s", stage, e.url, answered.status,
				upstreamMessage(into.Bytes())), false)
			if last.kv {
				return nil, last // the caller prefills locally
			}
		case errors.Is(err, errNotJSON):
			last = upstreamFailed(stage+" at "+e.url+" answered non-JSON", false)
		case timedOut(err):
			last = upstreamFailed(p.outOfTime(stage, e.url, err, until.Sub(started)), true)
		default:
			last = upstreamFailed(stage+" at "+e.url+": "+callFailure(err), false)
		}
		p.stats.retry(stage, "upstream_error") // post_json's, whether or not a replica is left
	}
	if last == nil {
		return nil, upstreamFailed("no endpoint", false)
	}
	return nil, last
}

// errClientLeft: the request's client went away: nobody to answer.
var errClientLeft = &failure{status: 499, message: "the client left", final: true}

// ended: the request's deadline passed (a 504 naming `stage` at `e`), or its client left.
func (p *plane) ended(ctx context.Context, stage string, e *endpoint, deadline bool) *failure {
	at, bounded := ctx.Deadline()
	switch err := ctx.Err(); {
	case errors.Is(err, context.Canceled):
		return errClientLeft
	case err != nil || (deadline && bounded && !time.Now().Before(at)):
		return p.pastDeadlineFailure(stage, e)
	}
	return nil
}

// answerStatus: the engine answered, with a status other than 200 (its body read into the
// call's buffer).
type answerStatus struct{ status int }

func (a *answerStatus) Error() string { return "HTTP " + strconv.Itoa(a.status) }

var errNotJSON = errors.New("answered non-JSON")

// callWithin posts and reads the answer whole into `into` by `until`: a 200 whose body is
// JSON, else why not (*answerStatus with the body read, errNotJSON, or the call's error).
func (p *plane) callWithin(ctx context.Context, e *endpoint, path string, body []byte,
	id, auth string, until time.Time, into *bytes.Buffer) error {
	into.Reset()
	e.inflight.Add(1)
	defer e.inflight.Add(-1)
	response, err := p.upstream.postWithin(ctx, e.at, path, body, id, auth, until)
	if err != nil {
		return err
	}
	defer response.Close()
	if _, err := into.ReadFrom(response); err != nil {
		return err
	}
	if response.status != http.StatusOK {
		return &answerStatus{response.status}
	}
	e.served.Add(1)
	if !jsonValue(into.Bytes()) {
		return errNotJSON
	}
	return nil
}

// jsonValue: the answer parses as JSON, as the Python gateway's loads requires of a 200. An
// object (the answer every call expects) is walked without a decoder.
func jsonValue(answer []byte) bool {
	if i := skipSpace(answer, 0); i < len(answer) && answer[i] == '{' {
		if end, err := valueEnd(answer, i); err == nil && skipSpace(answer, end) == len(answer) {
			return true
		}
	}
	return json.Valid(answer)
}

// abort stops the work a tokens engine does for request `id` (what the Python gateway's
// UpstreamClient.abort posts): an engine behind a proxy that keeps a call going when its
// client leaves stops only when told. Best effort, bounded.
func (p *plane) abort(e *endpoint, id, auth string) {
	p.stats.aborts.Add(1) // posted, answered or not: pdserve_gateway_upstream_aborts_total
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	body := []byte(`{"request_ids":[` + string(strconv.AppendQuote(nil, "generate-tokens-"+id)) + `]}`)
	response, err := p.upstream.post(ctx, e.at, abortPath, body, id, auth)
	if err != nil {
		return
	}
	_, _ = io.Copy(io.Discard, response)
	response.Close()
}

const abortPath = "/inference/v1/abort_requests"

// withoutAddresses is errors.without_addresses: the engine, render and peer addresses a
// failure's text names (URLs, IPv4 addresses, "host <name>:<port>") become "a replica". By
// hand, not a regular expression: Go's has no lookaround. Pinned to the Python gateway's by
// testdata/without_addresses.json, which both sides' tests read.
func withoutAddresses(message string) string {
	var out strings.Builder
	i, copied := 0, 0
	for i < len(message) {
		end := urlAt(message, i)
		if end < 0 && i >= 5 && message[i-5:i] == "host " {
			end = i + delimitedRun(message, i)
			if end == i {
				end = -1
			}
		}
		if end < 0 {
			end = ipv4At(message, i)
		}
		if end < 0 {
			i++
			continue
		}
		out.WriteString(message[copied:i])
		out.WriteString("a replica")
		i, copied = end, end
	}
	if copied == 0 {
		return message
	}
	out.WriteString(message[copied:])
	return out.String()
}

func wordByte(c byte) bool {
	return c == '_' || c >= 0x80 || ('0' <= c && c <= '9') || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z')
}

func boundary(s string, i int) bool {
	before := i > 0 && wordByte(s[i-1])
	after := i < len(s) && wordByte(s[i])
	return before != after
}

func addressDelimiter(c byte) bool {
	switch c {
	case ' ', '\t', '\n', '\r', '\f', '\v', ',', ';', '\'', '"', '(', ')', '[', ']':
		return true
	}
	return false
}

// delimitedRun: the length of the run at i of bytes that are not address delimiters.
func delimitedRun(s string, i int) int {
	n := 0
	for i+n < len(s) && !addressDelimiter(s[i+n]) {
		n++
	}
	return n
}

// urlAt: the end of `scheme://rest` at i (a trailing ':' before a space or the end left out),
// -1 when there is none.
func urlAt(s string, i int) int {
	if !boundary(s, i) || i >= len(s) || s[i] < 'a' || s[i] > 'z' {
		return -1
	}
	j := i + 1
	for j < len(s) && (('a' <= s[j] && s[j] <= 'z') || ('0' <= s[j] && s[j] <= '9') || s[j] == '+' || s[j] == '.' || s[j] == '-') {
		j++
	}
	if !strings.HasPrefix(s[j:], "://") {
		return -1
	}
	j += 3
	n := delimitedRun(s, j)
	if n == 0 {
		return -1
	}
	end := j + n
	if n > 1 && s[end-1] == ':' && (end == len(s) || isSpace(s[end])) {
		end--
	}
	return end
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// ipv4At: the end of an IPv4 address (with its port, if any) at i, -1 when there is none.
func ipv4At(s string, i int) int {
	if !boundary(s, i) {
		return -1
	}
	j := i
	for part := 0; part < 4; part++ {
		if part > 0 {
			if j >= len(s) || s[j] != '.' {
				return -1
			}
			j++
		}
		n := 0
		for j+n < len(s) && '0' <= s[j+n] && s[j+n] <= '9' {
			n++
		}
		if n == 0 || n > 3 {
			return -1
		}
		j += n
	}
	if j < len(s) && s[j] == ':' {
		k := j + 1
		for k < len(s) && '0' <= s[k] && s[k] <= '9' {
			k++
		}
		if k > j+1 && boundary(s, k) {
			return k
		}
	}
	if !boundary(s, j) {
		return -1
	}
	return j
}
