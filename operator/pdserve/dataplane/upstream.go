package main

// The engines' HTTP/1.1 client. net/http's Transport hands every request between the caller's
// goroutine and a reader and a writer goroutine per connection, and peeks each connection
// after every answer: on a proxy whose work is two small upstream calls per request, that was
// a fifth of its CPU. Here the caller writes the request (head and body in one writev) and
// reads the answer on its own goroutine; net/http still parses the answer (status, headers,
// Content-Length or chunked framing).

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"syscall"
	"time"
)

type upstreamPool struct {
	dialer    net.Dialer
	firstByte time.Duration // the answer's head must arrive within this
	idleFor   time.Duration // kept-alive connections older than this are closed, not reused
	mu        sync.Mutex
	idle      map[string][]*upConn // by host:port
}

type upConn struct {
	conn     net.Conn
	reader   *bufio.Reader
	host     string
	lastUsed time.Time
	reused   bool
}

var longAgo = time.Unix(1, 0)

func newUpstreamPool(connect, firstByte, idleFor time.Duration) *upstreamPool {
	return &upstreamPool{
		dialer:    net.Dialer{Timeout: connect, KeepAlive: 30 * time.Second},
		firstByte: firstByte, idleFor: idleFor, idle: map[string][]*upConn{},
	}
}

func (p *upstreamPool) get(ctx context.Context, host string) (*upConn, error) {
	now := time.Now()
	p.mu.Lock()
	for conns := p.idle[host]; len(conns) > 0; conns = p.idle[host] {
		c := conns[len(conns)-1]
		p.idle[host] = conns[:len(conns)-1]
		if now.Sub(c.lastUsed) < p.idleFor {
			p.mu.Unlock()
			c.reused = true
			return c, nil
		}
		c.conn.Close() // the engine may be closing it already (vLLM: after ~5 s)
	}
	p.mu.Unlock()
	conn, err := p.dialer.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, err
	}
	conn = newRawConn(conn)
	return &upConn{conn: conn, reader: bufio.NewReaderSize(conn, 16*1024), host: host}, nil
}

func (p *upstreamPool) put(c *upConn) {
	c.lastUsed = time.Now()
	p.mu.Lock()
	p.idle[c.host] = append(p.idle[c.host], c)
	p.mu.Unlock()
}

// endpointURL is an engine's address, parsed once.
type endpointURL struct {
	host string // host:port
	base string // the path prefix, without a trailing slash
	name string // the Host header
}

func parseEndpoint(raw string) (endpointURL, error) {
	parsed, err := url.Parse(raw)
	if err != nil || parsed.Scheme != "http" || parsed.Host == "" {
		return endpointURL{}, fmt.Errorf("routing table: engine %q is not an http://host:port URL", raw)
	}
	host := parsed.Host
	if parsed.Port() == "" {
		host = net.JoinHostPort(parsed.Hostname(), "80")
	}
	base := parsed.EscapedPath()
	for len(base) > 0 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	return endpointURL{host: host, base: base, name: parsed.Host}, nil
}

// post sends one JSON request and returns the answer's head; its body must be read to the end
// or closed. A kept-alive connection the engine closed meanwhile is retried once on a new one
// (the engine read nothing of it).
func (p *upstreamPool) post(ctx context.Context, at endpointURL, path string, body []byte,
	id, auth string) (*http.Response, error) {
	head := make([]byte, 0, 256)
	head = append(head, "POST "...)
	head = append(head, at.base...)
	head = append(head, path...)
	head = append(head, " HTTP/1.1\r\nHost: "...)
	head = append(head, at.name...)
	head = append(head, "\r\nContent-Type: application/json\r\nContent-Length: "...)
	head = strconv.AppendInt(head, int64(len(body)), 10)
	head = append(head, "\r\nX-Request-Id: "...)
	head = append(head, id...)
	if auth != "" {
		head = append(head, "\r\nAuthorization: "...)
		head = append(head, auth...)
	}
	head = append(head, "\r\n\r\n"...)
	for attempt := 0; ; attempt++ {
		c, err := p.get(ctx, at.host)
		if err != nil {
			return nil, err
		}
		response, err := p.exchange(ctx, c, head, body)
		if err == nil {
			return response, nil
		}
		c.conn.Close()
		if !c.reused || attempt > 0 || !stale(err) || ctx.Err() != nil {
			return nil, err
		}
	}
}

// stale: what writing to or reading from a connection the peer closed while idle gives.
func stale(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

func (p *upstreamPool) exchange(ctx context.Context, c *upConn, head, body []byte) (*http.Response, error) {
	// The request's context (the client's, bounded by the request timeout) unblocks any read
	// or write on the connection when it ends.
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(longAgo) })
	if err := writeHeadAndBody(c.conn, head, body); err != nil {
		stop()
		return nil, err
	}
	c.conn.SetReadDeadline(time.Now().Add(p.firstByte))
	response, err := http.ReadResponse(c.reader, nil)
	if err != nil {
		stop()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	c.conn.SetReadDeadline(time.Time{})
	response.Body = &upBody{ReadCloser: response.Body, pool: p, conn: c, stop: stop,
		reusable: !response.Close}
	return response, nil
}

// upBody gives the connection back once the answer was read to its end, else closes it (an
// engine serving a stream nobody reads any more stops when its connection closes).
type upBody struct {
	io.ReadCloser
	pool     *upstreamPool
	conn     *upConn
	stop     func() bool
	reusable bool
	done     bool
}

func (b *upBody) Read(chunk []byte) (int, error) {
	n, err := b.ReadCloser.Read(chunk)
	if err == io.EOF && !b.done {
		b.finish(true)
	}
	return n, err
}

func (b *upBody) Close() error {
	if !b.done {
		b.finish(false)
	}
	return nil
}

func (b *upBody) finish(complete bool) {
	b.done = true
	// stop() is false when the context already ended: its deadline is on the connection.
	if b.stop() && complete && b.reusable && b.conn.reader.Buffered() == 0 {
		b.pool.put(b.conn)
		return
	}
	b.conn.conn.Close()
}
