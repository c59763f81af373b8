package main

// The request log (the gateway's --request-log): one JSON Lines entry per request the data
// plane served, in the Python gateway's format (gateway/exchange.py log_entry; the keys and
// their order pinned by testdata/request_log_keys.json, which both sides' tests read), written
// to the file the Python gateway opened and passed down (-request-log-fd), where its own
// entries (the requests handed over) go too. Every line is one write, and each of the Python
// gateway's writes holds whole lines of at most PIPE_BUF bytes, so the two writers' lines never
// interleave: writes up to PIPE_BUF to a pipe (a container's standard output) are atomic, and
// so is each O_APPEND write to a file. Entries wait in a bounded queue for a writer of their
// own (a slow disk never holds a request up); past it they are dropped, and counted.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log"
	"math"
	"os"
	"sort"
	"strings"
	"sync/atomic"
	"time"
)

// requestLogPending is how many entries may wait for the writer (RequestLog's max_pending).
const requestLogPending = 10_000

type requestLog struct {
	file    *os.File
	lines   chan []byte
	stop    chan struct{}
	done    chan struct{}
	written atomic.Int64
	dropped atomic.Int64
}

// openRequestLog writes to the inherited descriptor fd (-request-log-fd); nil without one.
func openRequestLog(fd int) (*requestLog, error) {
	if fd < 0 {
		return nil, nil
	}
	file := os.NewFile(uintptr(fd), "request-log")
	if file == nil {
		return nil, fmt.Errorf("-request-log-fd %d is not an open file descriptor", fd)
	}
	if _, err := file.Stat(); err != nil {
		return nil, fmt.Errorf("-request-log-fd %d: %w (the Python gateway passes the request log it opened)", fd, err)
	}
	return newRequestLog(file), nil
}

func newRequestLog(file *os.File) *requestLog {
	l := &requestLog{file: file, lines: make(chan []byte, requestLogPending),
		stop: make(chan struct{}), done: make(chan struct{})}
	go l.run()
	return l
}

func (l *requestLog) run() {
	defer close(l.done)
	for {
		select {
		case line := <-l.lines:
			l.write(line)
		case <-l.stop:
			for {
				select {
				case line := <-l.lines:
					l.write(line)
				default:
					return
				}
			}
		}
	}
}

func (l *requestLog) write(line []byte) {
	if _, err := l.file.Write(line); err != nil {
		l.dropped.Add(1)
		return
	}
	l.written.Add(1)
}

// close writes what waits, then returns (the server stopped: nothing more is recorded).
func (l *requestLog) close() {
	if l == nil {
		return
	}
	close(l.stop)
	<-l.done
	if n := l.dropped.Load(); n > 0 {
		log.Printf("pdserve-dataplane: %d request log entries were dropped (the log did not keep up)", n)
	}
}

func (l *requestLog) record(line []byte) {
	select {
	case l.lines <- line:
	default:
		l.dropped.Add(1)
	}
}

func (l *requestLog) snapshot() map[string]int64 {
	return map[string]int64{"written": l.written.Load(), "dropped": l.dropped.Load()}
}

// requestLogJSON: what the routing table says the log names (absent: no log is kept).
type requestLogJSON struct {
	Routes map[string]string `json:"routes"` // the data plane's route -> the log's (and metrics') name
	Names  map[string]string `json:"names"`  // an engine as the table names it -> as the log does
}

// logged is what the request log says of one request, filled in as it is served.
type logged struct {
	sink      *requestLog
	names     *requestLogJSON
	clientID  string
	class     string
	requested []byte // the client's max_completion_tokens, else max_tokens, as sent (JSON)
	parity    string
	// Where it ran: the table's keys of its render server, prefill and decode engines.
	render, prefill, decode string
	autoReason              string
	firstChunk              time.Time
	gaps                    []time.Duration
	promptTokens            int64 // -1: not known
	outputTokens            int64 // -1: not known
	failed                  bool  // answered with an error (not a stream's error event): not logged
}

// newLogged starts the entry of a request of `class` whose X-Request-Id is clientID (kept as
// the response echoes it: printable ASCII of at most 256 characters, else none).
func newLogged(sink *requestLog, names *requestLogJSON, class, clientID string) *logged {
	l := &logged{sink: sink, names: names, class: class, promptTokens: -1, outputTokens: -1}
	if clientID != "" && len(clientID) <= 256 && printable(clientID) {
		l.clientID = clientID
	}
	return l
}

// usage reads an answer's usage (prompt and completion tokens) for the log.
func (l *logged) usage(answer []byte) {
	fields, err := topLevel(answer)
	if err != nil {
		return
	}
	counts, err := topLevel(lookup(fields, "usage"))
	if err != nil {
		return
	}
	l.promptTokens = count(lookup(counts, "prompt_tokens"))
	l.outputTokens = count(lookup(counts, "completion_tokens"))
}

// count: a token count as an answer states it; -1 for none.
func count(raw []byte) int64 {
	if n, ok := jsonInt(raw); ok && n >= 0 {
		return n
	}
	return -1
}

// tokensSent: how many token ids an event's choice carries (its token_ids, checked by
// eventPiece: an array, or null or missing for none).
func tokensSent(choice []member) int64 {
	tokens := lookup(choice, "token_ids")
	if len(tokens) < 2 || tokens[0] != '[' {
		return 0
	}
	return int64(countElements(tokens))
}

type logEntry struct {
	RequestID       string          `json:"request_id"`
	ClientRequestID *string         `json:"client_request_id"`
	Class           string          `json:"class"`
	Route           string          `json:"route"`
	PromptTokens    *int64          `json:"prompt_tokens"`
	Requested       json.RawMessage `json:"requested_output_tokens"`
	SentAtMs        int64           `json:"sent_at_ms"`
	FirstTokenAtMs  int64           `json:"first_token_at_ms"`
	FinishedAtMs    int64           `json:"finished_at_ms"`
	OutputTokens    *int64          `json:"output_tokens"`
	InterTokenP95   *float64        `json:"inter_token_ms_p95"`
	RenderEngine    *string         `json:"render_engine"`
	PrefillEngine   *string         `json:"prefill_engine"`
	DecodeEngine    *string         `json:"decode_engine"`
	ParityHash      *string         `json:"parity_hash"`
	AutoReason      *string         `json:"auto_reason"`
}

// line is the request's entry, newline included; s: the request as it ended.
func (l *logged) line(s *served) []byte {
	sentAt := s.started.UnixMilli()
	now := time.Now()
	first := l.firstChunk
	if first.IsZero() {
		first = now
	}
	requested := json.RawMessage("null")
	if len(l.requested) > 0 {
		requested = l.requested
	}
	entry := logEntry{
		RequestID: s.id, ClientRequestID: optional(l.clientID), Class: l.class,
		Route: l.names.Routes[s.route], PromptTokens: known(l.promptTokens), Requested: requested,
		SentAtMs: sentAt, FirstTokenAtMs: sentAt + first.Sub(s.started).Milliseconds(),
		FinishedAtMs: sentAt + now.Sub(s.started).Milliseconds(), OutputTokens: known(l.outputTokens),
		InterTokenP95: p95Millis(l.gaps), RenderEngine: l.name(l.render),
		PrefillEngine: l.name(l.prefill), DecodeEngine: l.name(l.decode),
		ParityHash: optional(l.parity), AutoReason: optional(l.autoReason),
	}
	var out bytes.Buffer
	encoder := json.NewEncoder(&out) // a newline after it
	encoder.SetEscapeHTML(false)     // as the Python gateway writes it
	if err := encoder.Encode(entry); err != nil {
		return nil
	}
	return out.Bytes()
}

// name: an engine as the log names it (its pod, with the rank), from its key in the table.
func (l *logged) name(key string) *string {
	if key == "" {
		return nil
	}
	if name, ok := l.names.Names[key]; ok {
		return &name
	}
	return &key
}

func optional(value string) *string {
	if value == "" {
		return nil
	}
	return &value
}

func known(n int64) *int64 {
	if n < 0 {
		return nil
	}
	return &n
}

// p95Millis is request_log.p95 of the gaps, in milliseconds rounded to two decimals.
func p95Millis(gaps []time.Duration) *float64 {
	if len(gaps) == 0 {
		return nil
	}
	ordered := append([]time.Duration(nil), gaps...)
	sort.Slice(ordered, func(i, j int) bool { return ordered[i] < ordered[j] })
	at := min(len(ordered)-1, int(0.95*float64(len(ordered))))
	ms := math.Round(ordered[at].Seconds()*1000*100) / 100
	return &ms
}

// className: the log's class of a request: its X-PDServe-Class as sent, else chat or
// completion.
func className(header string, chat bool) string {
	switch {
	case header != "":
		return header
	case chat:
		return "chat"
	}
	return "completion"
}

// validRequestLog checks a table's requestLog.
func validRequestLog(in *requestLogJSON) error {
	for _, route := range []string{routePD, routeDecode, routeRenderPD, routeRenderDecode} {
		if strings.TrimSpace(in.Routes[route]) == "" {
			return fmt.Errorf("routing table: requestLog.routes lacks %q", route)
		}
	}
	return nil
}
