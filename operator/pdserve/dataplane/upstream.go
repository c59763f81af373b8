package main

// The engines' HTTP/1.1 client. net/http's Transport hands every request between the caller's
// goroutine and a reader and a writer goroutine per connection, and peeks each connection
// after every answer: on a proxy whose work is two small upstream calls per request, that was
// a fifth of its CPU. Here the caller writes the request (head and body in one writev) and
// reads the answer on its own goroutine, and parses only what HTTP/1.1 framing needs of its
// head (net/http's parser kept every header in a map per answer: a fifth of the data plane's
// allocations, and the garbage collections they cost were its p99).

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

type upstreamPool struct {
	dialer net.Dialer
	// What https:// engines are dialed with: the system's roots (which SSL_CERT_FILE and
	// SSL_CERT_DIR replace, as they do for the Python gateway's own calls), a session cache
	// so a new connection resumes instead of a full handshake.
	tls       *tls.Config
	firstByte time.Duration // the answer's head must arrive within this
	keepFor   time.Duration // idle connections older than this are closed, open or not
	mu        sync.Mutex
	// By host:port, each in the order it was given back: the last is the most recently used
	// (reused first, so the fewest connections stay busy) and the first the longest idle.
	idle map[string][]*upConn
}

type upConn struct {
	conn   net.Conn
	reader *bufio.Reader
	head   []byte // the request head being sent, its buffer kept for the next
	pool   string // which idle list it goes back to: endpointURL.pool
	// The TCP connection under conn: the same, or the one a TLS conn wraps, whose socket is
	// peeked before a reuse (a TLS close_notify or anything else unasked makes it unusable).
	tcp      net.Conn
	lastUsed time.Time
	reused   bool
}

var longAgo = time.Unix(1, 0)

func newUpstreamPool(connect, firstByte, keepFor time.Duration) *upstreamPool {
	return &upstreamPool{
		dialer: net.Dialer{Timeout: connect, KeepAlive: 30 * time.Second},
		tls: &tls.Config{MinVersion: tls.VersionTLS12,
			ClientSessionCache: tls.NewLRUClientSessionCache(256)},
		firstByte: firstByte, keepFor: keepFor, idle: map[string][]*upConn{},
	}
}

// get takes an idle connection to host, or opens one. An idle connection is reused as long as
// its engine keeps it open (vLLM closes idle connections after about 5 s; a Go or Rust server
// keeps them), so a burst after a lull reuses what is still open instead of opening new ones
// while requests wait. Every reuse is checked first, however briefly the connection idled: an
// engine that closed it, or wrote past the end of its last answer, would have the next request
// read that close or those bytes as its answer (another request's, or a forged one). One
// non-blocking peek that allocates nothing: about half a microsecond per reuse
// (BenchmarkReusingAPooledConnection).
func (p *upstreamPool) get(ctx context.Context, at endpointURL) (*upConn, error) {
	now := time.Now()
	for c := p.pop(at.pool); c != nil; c = p.pop(at.pool) {
		if now.Sub(c.lastUsed) < p.keepFor && !peerClosed(c.tcp) {
			c.reused = true
			return c, nil
		}
		c.conn.Close() // outside the lock: a burst's requests wait for no one's close
	}
	conn, err := p.dialer.DialContext(ctx, "tcp", at.host)
	if err != nil {
		return nil, err
	}
	tcp := newRawConn(conn)
	conn = tcp
	if at.secure {
		config := p.tls.Clone()
		config.ServerName = at.serverName
		secured := tls.Client(tcp, config)
		// The connect timeout bounds the handshake too: it is part of opening the connection.
		handshake, cancel := context.WithTimeout(ctx, p.dialer.Timeout)
		err := secured.HandshakeContext(handshake)
		cancel()
		if err != nil {
			tcp.Close()
			// Part of connecting, as aiohttp counts it: retried elsewhere as a refused connect.
			return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: tcp.RemoteAddr(), Err: &handshakeError{err}}
		}
		conn = secured
	}
	return &upConn{conn: conn, tcp: tcp, reader: bufio.NewReaderSize(conn, 16*1024), pool: at.pool}, nil
}

// pop takes the most recently used idle connection to host, nil when there is none.
func (p *upstreamPool) pop(host string) *upConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	conns := p.idle[host]
	if len(conns) == 0 {
		return nil
	}
	c := conns[len(conns)-1]
	conns[len(conns)-1] = nil
	p.idle[host] = conns[:len(conns)-1]
	return c
}

// put gives a connection back and closes the longest idle one if it outlived keepFor: what a
// burst opened goes once the load that needed it has been gone that long. One with bytes
// already read past its answer is closed instead: they would be the next request's answer.
func (p *upstreamPool) put(c *upConn) {
	if c.reader.Buffered() > 0 {
		c.conn.Close()
		return
	}
	c.lastUsed = time.Now()
	var expired *upConn
	p.mu.Lock()
	conns := append(p.idle[c.pool], c)
	if c.lastUsed.Sub(conns[0].lastUsed) > p.keepFor {
		expired, conns[0] = conns[0], nil
		conns = conns[1:]
	}
	p.idle[c.pool] = conns
	p.mu.Unlock()
	if expired != nil {
		expired.conn.Close()
	}
}

// endpointURL is an engine's address, parsed once.
type endpointURL struct {
	host string // host:port
	// https://: TLS to the engine, its certificate checked for serverName (the URL's host).
	secure     bool
	serverName string
	pool       string // the idle connections it reuses: host:port, prefixed tls: for https
	base       string // the path prefix, without a trailing slash
	name       string // the Host header
	rank       string // the X-data-parallel-rank pinning one engine of a data-parallel pod; "" none
}

// rankFragment: how the routing table names one data-parallel rank of a server, `<url>#dp<n>`
// (the Python gateway's Endpoint.key), n being vLLM's local rank index.
const rankFragment = "dp"

func parseEndpoint(raw string) (endpointURL, error) {
	parsed, err := url.Parse(raw)
	if err != nil || (parsed.Scheme != "http" && parsed.Scheme != "https") || parsed.Host == "" {
		return endpointURL{}, fmt.Errorf("routing table: engine %q is not an http:// or https://host:port URL", raw)
	}
	secure := parsed.Scheme == "https"
	rank := ""
	if parsed.Fragment != "" {
		index, found := strings.CutPrefix(parsed.Fragment, rankFragment)
		if n, err := strconv.Atoi(index); !found || err != nil || n < 0 || strconv.Itoa(n) != index {
			return endpointURL{}, fmt.Errorf("routing table: engine %q: a fragment names a data-parallel rank, #%s<n>", raw, rankFragment)
		}
		rank = index
	}
	host := parsed.Host
	if parsed.Port() == "" {
		port := "80"
		if secure {
			port = "443"
		}
		host = net.JoinHostPort(parsed.Hostname(), port)
	}
	pool := host
	if secure {
		pool = "tls:" + host
	}
	base := parsed.EscapedPath()
	for len(base) > 0 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	return endpointURL{host: host, secure: secure, serverName: parsed.Hostname(), pool: pool,
		base: base, name: parsed.Host, rank: rank}, nil
}

// post sends one JSON request and returns the answer's head; its body must be read to the end
// or closed. A kept-alive connection the engine closed meanwhile is retried once on a new one
// (the engine read nothing of it).
func (p *upstreamPool) post(ctx context.Context, at endpointURL, path string, body []byte,
	id, auth string) (*upBody, error) {
	return p.postWithin(ctx, at, path, body, id, auth, time.Time{})
}

// postWithin is post with the whole answer, body included, due by `until` (the Python
// gateway's total timeout of a JSON call; a read after it fails with os.ErrDeadlineExceeded),
// not its head by the first-byte timeout.
func (p *upstreamPool) postWithin(ctx context.Context, at endpointURL, path string, body []byte,
	id, auth string, until time.Time) (*upBody, error) {
	for attempt := 0; ; attempt++ {
		c, err := p.get(ctx, at)
		if err != nil {
			return nil, err
		}
		c.head = requestHead(c.head[:0], at, path, len(body), id, auth)
		answer, err := p.exchange(ctx, c, c.head, body, until)
		if err == nil {
			return answer, nil
		}
		c.conn.Close()
		if !c.reused || attempt > 0 || !neverRead(err) || ctx.Err() != nil {
			return nil, err
		}
	}
}

// requestHead appends a request's head to `into` (the connection's own buffer: no allocation
// per request once it has grown).
func requestHead(into []byte, at endpointURL, path string, length int, id, auth string) []byte {
	into = append(into, "POST "...)
	into = append(into, at.base...)
	into = append(into, path...)
	into = append(into, " HTTP/1.1\r\nHost: "...)
	into = append(into, at.name...)
	into = append(into, "\r\nContent-Type: application/json\r\nContent-Length: "...)
	into = strconv.AppendInt(into, int64(length), 10)
	into = append(into, "\r\nX-Request-Id: "...)
	into = append(into, id...)
	if at.rank != "" {
		into = append(into, "\r\nX-data-parallel-rank: "...)
		into = append(into, at.rank...)
	}
	if auth != "" {
		into = append(into, "\r\nAuthorization: "...)
		into = append(into, auth...)
	}
	return append(into, "\r\n\r\n"...)
}

// neverRead: the engine cannot have read the request, so sending it again does no work twice:
// writing failed, or the request reached a socket the engine had closed (it answers with a
// reset). A clean close after the request was written is an engine that read it and went
// away (the Python gateway's ServerDisconnectedError): not sent again, as aiohttp does not.
func neverRead(err error) bool {
	var write *writeError
	if errors.As(err, &write) {
		err = write.err
		return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
			errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
	}
	return errors.Is(err, syscall.ECONNRESET)
}

// handshakeError: the TLS handshake with an https:// engine failed, its certificate untrusted
// or the engine not speaking TLS.
type handshakeError struct{ err error }

func (h *handshakeError) Error() string { return h.err.Error() }
func (h *handshakeError) Unwrap() error { return h.err }

// words names it as aiohttp's connector errors are named (errors.upstream_failure).
func (h *handshakeError) words() string {
	var verify *tls.CertificateVerificationError
	if errors.As(h.err, &verify) {
		return "ClientConnectorCertificateError: certificate verify failed: " + verify.Err.Error()
	}
	return "ClientConnectorSSLError: " + h.err.Error()
}

// writeError: sending the request failed.
type writeError struct{ err error }

func (w *writeError) Error() string { return w.err.Error() }
func (w *writeError) Unwrap() error { return w.err }

func (p *upstreamPool) exchange(ctx context.Context, c *upConn, head, body []byte, until time.Time) (*upBody, error) {
	// The request's context (the client's, bounded by the request timeout) unblocks any read
	// or write on the connection when it ends.
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(longAgo) })
	if err := writeHeadAndBody(c.conn, head, body); err != nil {
		stop()
		return nil, &writeError{err}
	}
	if until.IsZero() {
		c.conn.SetReadDeadline(time.Now().Add(p.firstByte))
	} else {
		c.conn.SetReadDeadline(until)
	}
	answer := &upBody{pool: p, conn: c, stop: stop}
	if err := answer.readHead(c.reader); err != nil {
		stop()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	c.conn.SetReadDeadline(until)
	if ctx.Err() != nil {
		c.conn.SetDeadline(longAgo) // the context's own may have come before the line above
	}
	if answer.framing == framedByLength && answer.left == 0 {
		answer.finish(true) // nothing to read: the connection goes back now
	}
	return answer, nil
}

// upBody is an engine's answer: its status and its body, read as it arrives. It gives the
// connection back once the body was read to its end, else closes it (an engine serving a
// stream nobody reads any more stops when its connection closes).
type upBody struct {
	status    int
	framing   framing
	left      int64 // of the body (framedByLength) or of the current chunk (chunked)
	keepAlive bool
	pool      *upstreamPool
	conn      *upConn
	stop      func() bool
	done      atomic.Bool // the connection was given back or closed
	err       error       // what every later Read returns once the body ended or broke
	expired   atomic.Bool // closed by the caller's timer: the engine went quiet
}

// expire closes the answer because the engine went quiet (a stream's timer, from its own
// goroutine).
func (b *upBody) expire() {
	b.expired.Store(true)
	b.Close()
}

type framing int

const (
	framedByLength framing = iota
	chunked
	untilClose // HTTP/1.0 style: the body ends when the engine closes the connection
)

// The answer head's limits: an engine's is a few hundred bytes.
const (
	maxHeadLines = 100
	maxHeadBytes = 64 * 1024
)

var errMalformedAnswer = errors.New("malformed answer from the engine")

func malformed(what string, line []byte) error {
	if len(line) > 80 {
		line = line[:80]
	}
	return fmt.Errorf("%w: %s (%q)", errMalformedAnswer, what, line)
}

// readHead reads the status line and the headers HTTP/1.1 framing needs (Content-Length,
// Transfer-Encoding, Connection); the rest are skipped, not kept. Interim 1xx answers are
// skipped as well.
func (b *upBody) readHead(reader *bufio.Reader) error {
	for {
		line, err := headLine(reader)
		if err != nil {
			return err
		}
		minor, status, ok := parseStatusLine(line)
		if !ok {
			return malformed("status line", line)
		}
		if status == http.StatusSwitchingProtocols {
			return malformed("protocol switch", line)
		}
		b.status, b.keepAlive = status, minor >= 1
		if err := b.readHeaders(reader, minor); err != nil {
			return err
		}
		if status >= 200 {
			return nil
		}
	}
}

func (b *upBody) readHeaders(reader *bufio.Reader, minor int) error {
	length, lengthSeen, isChunked, total := int64(0), false, false, 0
	for lines := 0; ; lines++ {
		line, err := headLine(reader)
		if err != nil {
			return err
		}
		if len(line) == 0 {
			break
		}
		if total += len(line); total > maxHeadBytes || lines >= maxHeadLines {
			return malformed("head too large", line)
		}
		if line[0] == ' ' || line[0] == '\t' {
			return malformed("obs-fold continuation line", line) // RFC 9112 5.2: rejected
		}
		name, value, ok := headerField(line)
		if !ok {
			return malformed("header line", line)
		}
		switch {
		case asciiEqualFold(name, "content-length"):
			parsed, err := strconv.ParseInt(string(value), 10, 64)
			if err != nil || parsed < 0 || value[0] == '+' || (lengthSeen && parsed != length) {
				return malformed("Content-Length", line)
			}
			length, lengthSeen = parsed, true
		case asciiEqualFold(name, "transfer-encoding"):
			if !asciiEqualFold(value, "chunked") {
				return malformed("Transfer-Encoding other than chunked", line)
			}
			isChunked = true
		case asciiEqualFold(name, "connection"):
			for _, option := range bytes.Split(value, []byte(",")) {
				option = bytes.Trim(option, " \t")
				if asciiEqualFold(option, "close") {
					b.keepAlive = false
				} else if asciiEqualFold(option, "keep-alive") {
					b.keepAlive = true
				}
			}
		}
	}
	if isChunked && minor == 0 {
		// RFC 9112 6.1: framing an HTTP/1.0 message cannot be trusted with (Go's client reads
		// such a body to the close, as if it were not chunked).
		return malformed("Transfer-Encoding in an HTTP/1.0 answer", nil)
	}
	switch {
	case b.status < 200 || b.status == http.StatusNoContent || b.status == http.StatusNotModified:
		b.framing, b.left = framedByLength, 0
	case isChunked:
		// With a Content-Length beside it the chunks count (RFC 9112 6.3); the connection is
		// not trusted again.
		b.framing, b.left = chunked, -1
		b.keepAlive = b.keepAlive && !lengthSeen
	case lengthSeen:
		b.framing, b.left = framedByLength, length
	default:
		b.framing, b.keepAlive = untilClose, false
	}
	return nil
}

// headLine is one line of the head without its CRLF (or bare LF), borrowed from the reader's
// buffer until its next read.
func headLine(reader *bufio.Reader) ([]byte, error) {
	line, err := lineSlice(reader, "head line too long")
	if err != nil {
		return nil, err
	}
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, nil
}

// parseStatusLine reads "HTTP/1.x NNN reason".
func parseStatusLine(line []byte) (minor, status int, ok bool) {
	if len(line) < 12 || string(line[:7]) != "HTTP/1." || line[8] != ' ' ||
		(len(line) > 12 && line[12] != ' ') {
		return 0, 0, false
	}
	if line[7] < '0' || line[7] > '9' {
		return 0, 0, false
	}
	for _, digit := range line[9:12] {
		if digit < '0' || digit > '9' {
			return 0, 0, false
		}
		status = status*10 + int(digit-'0')
	}
	return int(line[7] - '0'), status, status >= 100
}

// headerField splits `name: value`; false when it is not a header line Go's client would
// read (RFC 9110 5.1, 5.5).
func headerField(line []byte) (name, value []byte, ok bool) {
	colon := bytes.IndexByte(line, ':')
	if colon <= 0 || !isToken(line[:colon]) || !isFieldValue(line[colon+1:]) {
		return nil, nil, false
	}
	return line[:colon], bytes.Trim(line[colon+1:], " \t"), true
}

// isToken: a header name is a token (RFC 9110 5.6.2): no space before its colon, no
// delimiter or control byte in it.
func isToken(name []byte) bool {
	for _, c := range name {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
			bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0) {
			return false
		}
	}
	return len(name) > 0
}

// isFieldValue: no control byte but HTAB in a header's value (a bare CR included: RFC 9112 2.2).
func isFieldValue(value []byte) bool {
	for _, c := range value {
		if (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// asciiEqualFold compares a header token with a lowercase name, ignoring ASCII case.
func asciiEqualFold(token []byte, lower string) bool {
	if len(token) != len(lower) {
		return false
	}
	for i, c := range token {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != lower[i] {
			return false
		}
	}
	return true
}

func (b *upBody) Read(into []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	n, err := b.read(into)
	if err != nil {
		b.err = err
		b.finish(err == io.EOF)
	}
	return n, err
}

func (b *upBody) read(into []byte) (int, error) {
	reader := b.conn.reader
	switch b.framing {
	case untilClose:
		return reader.Read(into)
	case framedByLength:
		if b.left == 0 {
			return 0, io.EOF
		}
		if int64(len(into)) > b.left {
			into = into[:b.left]
		}
		n, err := reader.Read(into)
		b.left -= int64(n)
		if err == io.EOF {
			return n, io.ErrUnexpectedEOF // the engine closed it before the body's end
		}
		if err == nil && b.left == 0 {
			err = io.EOF
		}
		return n, err
	}
	if b.left <= 0 {
		if err := b.nextChunk(reader); err != nil {
			return 0, err
		}
	}
	n, err := reader.Read(into[:min(int64(len(into)), b.left)])
	b.left -= int64(n)
	if err == io.EOF {
		return n, io.ErrUnexpectedEOF
	}
	if err != nil {
		return n, err
	}
	return b.readBuffered(reader, into, n)
}

// readBuffered adds to into[:n] the chunks that came in with the one just read, as far as the
// reader's buffer holds them (no system call): a stream's events that arrived together go to
// the client in one write, not one each (writes to the client are two fifths of the CPU a
// stream costs). io.EOF when that reached the last chunk.
func (b *upBody) readBuffered(reader *bufio.Reader, into []byte, n int) (int, error) {
	for b.left == 0 && n < len(into) && chunkFramingBuffered(reader) {
		if err := b.nextChunk(reader); err != nil {
			return n, err
		}
		room := into[n:min(int64(len(into)), int64(n)+b.left, int64(n+reader.Buffered()))]
		if len(room) == 0 {
			break // the chunk's data has not arrived yet
		}
		m, _ := reader.Read(room) // from the buffer: it holds all of room
		n += m
		b.left -= int64(m)
	}
	return n, nil
}

// chunkFramingBuffered: whether the CRLF ending the chunk just read and the next chunk's size
// line (for the last chunk, also the blank line ending it) are in the reader's buffer whole,
// so that nextChunk reads them without waiting for the engine.
func chunkFramingBuffered(reader *bufio.Reader) bool {
	buffered, _ := reader.Peek(reader.Buffered())
	end := bytes.IndexByte(buffered, '\n')
	if end < 0 {
		return false
	}
	rest := buffered[end+1:]
	sizeEnd := bytes.IndexByte(rest, '\n')
	if sizeEnd < 0 {
		return false
	}
	if size, ok := chunkSize(bytes.TrimSuffix(rest[:sizeEnd], []byte("\r"))); size > 0 || !ok {
		return true // a chunk with data follows (or a malformed size line nextChunk names)
	}
	after := rest[sizeEnd+1:]
	return bytes.HasPrefix(after, []byte("\r\n")) || bytes.HasPrefix(after, []byte("\n"))
}

// nextChunk reads the CRLF ending the chunk before (if any) and the next chunk's size line; at
// the last (empty) chunk it reads the trailer lines to the head's end and answers io.EOF.
func (b *upBody) nextChunk(reader *bufio.Reader) error {
	if b.left == 0 { // a chunk's data was read: its CRLF follows
		line, err := chunkLine(reader)
		if err != nil {
			return unexpected(err)
		}
		if len(line) != 0 {
			return malformed("chunk end", line)
		}
	}
	line, err := chunkLine(reader)
	if err != nil {
		return unexpected(err)
	}
	size, ok := chunkSize(line)
	if !ok {
		return malformed("chunk size", line)
	}
	if size > 0 {
		b.left = int64(size)
		return nil
	}
	for lines := 0; ; lines++ { // the trailer, up to its blank line
		line, err := chunkLine(reader)
		if err != nil {
			return unexpected(err)
		}
		if len(line) == 0 {
			return io.EOF
		}
		if _, _, ok := headerField(line); !ok {
			return malformed("trailer line", line)
		}
		if lines >= maxHeadLines {
			return malformed("trailer too large", line)
		}
	}
}

// lineSlice is the next line with its LF, borrowed from the reader's buffer; a line longer
// than the buffer is malformed (`tooLong` says which).
func lineSlice(reader *bufio.Reader, tooLong string) ([]byte, error) {
	line, err := reader.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		return nil, malformed(tooLong, line)
	}
	if err != nil {
		if err == io.EOF && len(line) > 0 {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return line, nil
}

// chunkLine is a chunk's size line or the end of its data, which must end with CRLF: a bare LF
// there is where parsers disagree on a body's end (Go's client refuses it too).
func chunkLine(reader *bufio.Reader) ([]byte, error) {
	line, err := lineSlice(reader, "chunk line too long")
	if err != nil {
		return nil, err
	}
	if len(line) < 2 || line[len(line)-2] != '\r' {
		return nil, malformed("chunk line ends with a bare LF", line)
	}
	return line[:len(line)-2], nil
}

// chunkSize is a chunk size line's size (its extensions ignored); false when it is not one.
func chunkSize(line []byte) (uint64, bool) {
	if semicolon := bytes.IndexByte(line, ';'); semicolon >= 0 {
		line = line[:semicolon]
	}
	size, err := strconv.ParseUint(string(bytes.TrimRight(line, " \t")), 16, 62)
	return size, err == nil && len(line) > 0
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// Close may come from another goroutine than the reads (a stream's idle timer): closing the
// connection unblocks a read waiting on it.
func (b *upBody) Close() error {
	b.finish(false)
	return nil
}

func (b *upBody) finish(complete bool) {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	// stop() is false when the context already ended: its deadline is on the connection.
	if b.stop() && complete && b.keepAlive {
		whileWaiting(b.conn.tcp, nil) // the next request's reads are its own
		b.pool.put(b.conn)
		return
	}
	b.conn.conn.Close()
}
