package main

// Strict HTTP/1.1 message framing on every client connection, checked before Go's parser sees
// the bytes. Go's parser is lenient where RFC 9112 says to refuse (both Content-Length and
// Transfer-Encoding: it drops Content-Length and keeps the connection, so a request's body
// can be read as the next request; duplicate Content-Length; obs-fold; bare LF), and what it
// refuses it answers in text/plain. The Python gateway (aiohttp's llhttp) refuses all of those
// in the OpenAI error shape and closes the connection; what a client sees must not depend on
// which of the two serves it (docs/gateway.md).
//
// framedConn follows each message's framing as the bytes pass through Read (head, then a body
// by Content-Length or by chunked framing, then the next head) without copying them, so it
// always agrees with Go's parser on where a message ends. At the first fault it hands Go only
// the bytes before it, answers the Python gateway's status and words itself once Go has
// nothing else to answer, and closes the connection.

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"
)

// aiohttp's limits (web.Server's defaults, which the Python gateway keeps): a request target,
// or a header's name and value together, over maxField bytes is 431; more than maxHeaders
// headers is 400.
const (
	maxField   = 8190
	maxHeaders = 128
	// Go's chunked reader refuses a chunk-size line over 4096 bytes: refuse it first, in words.
	maxChunkLine = 4000
	// Go's own limit on a head, above the most the checks let through (128 fields of 8190).
	maxHeaderBytes = 2 << 20
)

// fault is a refusal: the status and error the Python gateway answers for the same bytes.
type fault struct {
	status  int
	kind    string
	message string
}

func invalid(reason string) *fault {
	// errors.framing_error's words for what llhttp refuses.
	return &fault{400, "BadRequestError", "the request is not valid HTTP/1.1: " + reason}
}

var (
	faultLineTooLong = &fault{431, "RequestHeaderFieldsTooLarge", fmt.Sprintf(
		"a request header (or the request line) is longer than %d bytes, the most the gateway reads; send shorter headers", maxField)}
	faultBothLengths = &fault{400, "BadRequestError", "the request has both Content-Length and Transfer-Encoding headers; send one: Content-Length for a body of known size, or Transfer-Encoding: chunked"}
	faultMethod      = invalid("Invalid method encountered")
	faultURL         = invalid("Invalid characters in url")
	faultVersion     = invalid("Invalid HTTP version: send HTTP/1.1")
	faultLineLF      = invalid("Missing expected LF after request line")
	faultToken       = invalid("Invalid header token")
	faultValueChar   = invalid("Invalid header value char")
	faultValueCR     = invalid("Missing expected CR after header value")
	faultHeaderLF    = invalid("Missing expected LF after header value")
	faultFold        = invalid("Unexpected whitespace after header value")
	faultTooMany     = invalid("Too many headers received")
	faultLength      = invalid("Invalid character in Content-Length")
	faultLengthTwice = invalid("Duplicate Content-Length")
	faultCoding      = invalid("Request has invalid `Transfer-Encoding`")
	faultCodingTwice = invalid("Invalid `Transfer-Encoding` header value")
	faultCoding10    = invalid("Transfer-Encoding in an HTTP/1.0 request; send Content-Length")
	faultNoHost      = invalid("Missing 'Host' header in request.")
	faultChunkSize   = invalid("Invalid character in chunk size")
	faultChunkLine   = invalid("Chunk size line too long")
	faultChunkCR     = invalid("Missing expected CR after chunk size")
	faultChunkLF     = invalid("Missing expected LF after chunk size")
	faultChunkData   = invalid("Expected LF after chunk data")
)

// Singleton headers aiohttp refuses twice ("Duplicate '<name>' header found."), by bit.
var singletons = []string{"Content-Location", "Content-Range", "Content-Type", "ETag", "Host",
	"Max-Forwards", "Server", "User-Agent"}

const (
	fieldOther = iota
	fieldLength
	fieldCoding
	fieldExpect
	fieldSingleton // + index in singletons
)

func fieldOf(lower []byte) int {
	switch string(lower) {
	case "content-length":
		return fieldLength
	case "transfer-encoding":
		return fieldCoding
	case "expect":
		return fieldExpect
	case "content-location":
		return fieldSingleton
	case "content-range":
		return fieldSingleton + 1
	case "content-type":
		return fieldSingleton + 2
	case "etag":
		return fieldSingleton + 3
	case "host":
		return fieldSingleton + 4
	case "max-forwards":
		return fieldSingleton + 5
	case "server":
		return fieldSingleton + 6
	case "user-agent":
		return fieldSingleton + 7
	}
	return fieldOther
}

// Where the scan is in the byte stream.
const (
	sStart = iota // before a request line (empty lines are skipped, as llhttp does)
	sStartLF
	sMethod
	sTarget
	sVersion
	sLineLF
	sFieldStart
	sName
	sValueSpace
	sValue
	sValueLF
	sHeadLF
	sBody
	sChunkSize
	sChunkExt
	sChunkSizeLF
	sChunkData
	sChunkDataCR
	sChunkDataLF
)

// tokenChar: RFC 9110's tchar.
var tokenChar = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c], t[c-'a'+'A'] = true, true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return
}()

// requestFraming is one connection's scan state.
type requestFraming struct {
	state      uint8
	trailer    bool // the field lines after a chunked body's last chunk
	http10     bool
	chunked    bool
	hasLength  bool
	expect     bool
	length     int64 // Content-Length; then what is left of the body or of a chunk
	count      int   // field lines, or a request line's or chunk-size line's length
	nameLen    int
	valueLen   int
	field      int
	singletons uint16
	name       [20]byte // a field name, lower case, while it is one the checks read
	value      [48]byte // its value, while it is one the checks read
	maxBody    int64
	fault      *fault
	headEnded  bool // since the connection last looked
	// onMessage, in tests: the stream offset where each message (with its body) ended.
	onMessage func(end int64)
	offset    int64
}

// scan checks b, the next bytes of the stream, in place; it returns how many of them go to
// Go's parser: all but the empty lines before a request line, up to the first fault (then
// f.fault is set).
func (f *requestFraming) scan(b []byte) int {
	kept := 0 // b[:kept] is what goes on; equal to i until a byte is dropped
	i := 0
	for i < len(b) {
		c := b[i]
		switch f.state {
		case sBody, sChunkData:
			n := int(min(f.length, int64(len(b)-i)))
			f.length -= int64(n)
			if kept != i {
				copy(b[kept:], b[i:i+n])
			}
			kept, i = kept+n, i+n
			if f.length == 0 {
				if f.state == sChunkData {
					f.state = sChunkDataCR
				} else {
					f.end(kept)
				}
			}
			continue
		case sStart:
			switch {
			case c == '\r':
				f.state = sStartLF
				i++ // dropped: Go's parser refuses an empty line where a request line goes
				continue
			case tokenChar[c]:
				f.state, f.count = sMethod, 0
				f.http10, f.chunked, f.hasLength, f.expect = false, false, false, false
				f.singletons, f.length = 0, 0
			default:
				return f.refuse(faultMethod, kept)
			}
		case sStartLF:
			if c != '\n' {
				return f.refuse(faultLineLF, kept)
			}
			f.state = sStart
			i++
			continue
		case sMethod:
			if c == ' ' {
				f.state = sTarget
			} else if !tokenChar[c] {
				return f.refuse(faultMethod, kept)
			}
		case sTarget:
			if c == ' ' && f.count > 0 {
				f.state, f.count = sVersion, 0
				break
			}
			if c <= ' ' || c == 0x7f {
				return f.refuse(faultURL, kept)
			}
			if f.count++; f.count > maxField {
				return f.refuse(faultLineTooLong, kept)
			}
		case sVersion:
			if c == '\r' {
				if f.count != 8 || string(f.value[:5]) != "HTTP/" || f.value[5] != '1' || f.value[6] != '.' ||
					(f.value[7] != '0' && f.value[7] != '1') {
					return f.refuse(faultVersion, kept)
				}
				f.http10 = f.value[7] == '0'
				f.state = sLineLF
				break
			}
			if f.count >= 8 {
				return f.refuse(faultVersion, kept)
			}
			f.value[f.count] = c
			f.count++
		case sLineLF:
			if c != '\n' {
				return f.refuse(faultLineLF, kept)
			}
			f.state, f.count = sFieldStart, 0
		case sFieldStart:
			switch {
			case c == '\r':
				f.state = sHeadLF
			case tokenChar[c]:
				if f.count++; f.count > maxHeaders {
					return f.refuse(faultTooMany, kept)
				}
				f.state, f.nameLen, f.valueLen = sName, 1, 0
				f.name[0] = lower(c)
			case c == ' ' || c == '\t':
				return f.refuse(faultFold, kept)
			case c == '\n':
				return f.refuse(faultValueCR, kept)
			default:
				return f.refuse(faultToken, kept)
			}
		case sName:
			if c == ':' {
				f.field = fieldOther
				if f.nameLen <= len(f.name) && !f.trailer {
					f.field = fieldOf(f.name[:f.nameLen])
				}
				f.state = sValueSpace
				break
			}
			if !tokenChar[c] {
				return f.refuse(faultToken, kept)
			}
			if f.nameLen < len(f.name) {
				f.name[f.nameLen] = lower(c)
			}
			if f.nameLen++; f.nameLen > maxField {
				return f.refuse(faultLineTooLong, kept)
			}
		case sValueSpace:
			if c == ' ' || c == '\t' {
				break
			}
			f.state = sValue
			continue // the value's first byte
		case sValue:
			j := i
			for j < len(b) && (b[j] >= ' ' && b[j] != 0x7f || b[j] == '\t') {
				j++
			}
			if f.field != fieldOther && f.valueLen < len(f.value) {
				copy(f.value[f.valueLen:], b[i:j])
			}
			f.valueLen += j - i
			if f.nameLen+f.valueLen > maxField {
				return f.refuse(faultLineTooLong, kept)
			}
			if kept != i {
				copy(b[kept:], b[i:j])
			}
			kept, i = kept+j-i, j
			if i == len(b) {
				continue
			}
			switch b[i] {
			case '\r':
				f.state = sValueLF
			case '\n':
				return f.refuse(faultValueCR, kept)
			default:
				return f.refuse(faultValueChar, kept)
			}
		case sValueLF:
			if c != '\n' {
				return f.refuse(faultHeaderLF, kept)
			}
			if bad := f.header(); bad != nil {
				return f.refuse(bad, kept)
			}
			f.state = sFieldStart
		case sHeadLF:
			if c != '\n' {
				return f.refuse(faultHeaderLF, kept)
			}
			if !f.trailer {
				if bad := f.head(); bad != nil {
					return f.refuse(bad, kept)
				}
				f.headEnded = true
			}
			if kept != i {
				b[kept] = b[i]
			}
			kept, i = kept+1, i+1
			switch {
			case f.trailer:
				f.trailer = false
				f.end(kept)
			case f.chunked:
				f.state, f.length, f.count = sChunkSize, 0, 0
			case f.length > 0:
				f.state = sBody
			default:
				f.end(kept)
			}
			continue
		case sChunkSize:
			d := unhex(c)
			switch {
			case d >= 0:
				if f.length > 1<<40 {
					return f.refuse(faultChunkSize, kept)
				}
				f.length = f.length<<4 | int64(d)
			case f.count == 0:
				return f.refuse(faultChunkSize, kept)
			case c == ';':
				f.state = sChunkExt
			case c == '\r':
				f.state = sChunkSizeLF
			case c == '\n':
				return f.refuse(faultChunkCR, kept)
			default:
				return f.refuse(faultChunkSize, kept)
			}
			if f.count++; f.count > maxChunkLine {
				return f.refuse(faultChunkLine, kept)
			}
		case sChunkExt:
			if c == '\r' {
				f.state = sChunkSizeLF
				break
			}
			if c < ' ' && c != '\t' || c == 0x7f {
				return f.refuse(faultChunkSize, kept)
			}
			if f.count++; f.count > maxChunkLine {
				return f.refuse(faultChunkLine, kept)
			}
		case sChunkSizeLF:
			if c != '\n' {
				return f.refuse(faultChunkLF, kept)
			}
			if f.length == 0 {
				f.state, f.trailer, f.count = sFieldStart, true, 0
			} else {
				f.state = sChunkData
			}
		case sChunkDataCR:
			if c != '\r' {
				return f.refuse(faultChunkData, kept)
			}
			f.state = sChunkDataLF
		case sChunkDataLF:
			if c != '\n' {
				return f.refuse(faultChunkData, kept)
			}
			f.state, f.length, f.count = sChunkSize, 0, 0
		}
		if kept != i {
			b[kept] = b[i]
		}
		kept, i = kept+1, i+1
	}
	f.offset += int64(kept)
	return kept
}

// end: a message ended after the first `kept` bytes this scan passes on.
func (f *requestFraming) end(kept int) {
	f.state = sStart
	if f.onMessage != nil {
		f.onMessage(f.offset + int64(kept))
	}
}

func (f *requestFraming) refuse(bad *fault, kept int) int {
	f.fault = bad
	f.offset += int64(kept)
	return kept
}

// header checks the field line that just ended.
func (f *requestFraming) header() *fault {
	if f.field == fieldOther {
		return nil
	}
	value := f.value[:min(f.valueLen, len(f.value))]
	for len(value) > 0 && (value[len(value)-1] == ' ' || value[len(value)-1] == '\t') {
		value = value[:len(value)-1]
	}
	long := f.valueLen > len(f.value)
	switch f.field {
	case fieldLength:
		if f.hasLength {
			return faultLengthTwice
		}
		if len(value) == 0 || long || len(value) > 18 {
			return faultLength
		}
		n := int64(0)
		for _, d := range value {
			if d < '0' || d > '9' {
				return faultLength
			}
			n = n*10 + int64(d-'0')
		}
		f.hasLength, f.length = true, n
	case fieldCoding:
		if f.chunked {
			return faultCodingTwice
		}
		if long || !equalFold(value, "chunked") {
			return faultCoding
		}
		f.chunked = true
	case fieldExpect:
		if f.expect {
			return nil // the first one is the one both servers read
		}
		f.expect = true
		if long || !equalFold(value, "100-continue") {
			shown := string(value)
			if long {
				shown += "..."
			}
			return &fault{417, "ExpectationFailed",
				fmt.Sprintf("unknown Expect: %s; only 100-continue is understood", shown)}
		}
	default:
		bit := uint16(1) << (f.field - fieldSingleton)
		if f.singletons&bit != 0 {
			return invalid(fmt.Sprintf("Duplicate '%s' header found.", singletons[f.field-fieldSingleton]))
		}
		f.singletons |= bit
	}
	return nil
}

// head checks the head that just ended as a whole.
func (f *requestFraming) head() *fault {
	switch {
	case f.chunked && f.hasLength:
		return faultBothLengths
	case f.chunked && f.http10:
		// RFC 9112 6.1: Go's parser ignores it there, llhttp does not: their framings differ.
		return faultCoding10
	case !f.http10 && f.singletons&(1<<4) == 0:
		return faultNoHost
	case f.expect && !f.http10 && f.hasLength && f.length > f.maxBody:
		// Refused before the client sends the body it asked about.
		refused := tooLarge(f.maxBody)
		return &fault{refused.status, refused.kind, refused.message}
	}
	return nil
}

func lower(c byte) byte {
	if 'A' <= c && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

func equalFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		if lower(b[i]) != s[i] {
			return false
		}
	}
	return true
}

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c-'a') + 10
	case 'A' <= c && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// framedConn is a client connection whose reads are checked (requestFraming) before Go's server
// parses them.
type framedConn struct {
	net.Conn
	requestFraming
	// Go's server's state of the connection (Server.ConnState): Active while a request's
	// handler runs, when a read is the server's background one (watching for the client
	// leaving) and the refusal must wait for the answer under way.
	serverState atomic.Int32
	writes      atomic.Int64 // answers' writes: whether one began since the current head
	headWrites  int64        // writes when the current message's head ended
	refused     atomic.Bool
	answered    bool
}

func newFramedConn(conn net.Conn, maxBody int64) *framedConn {
	c := &framedConn{Conn: conn}
	c.maxBody = maxBody
	c.serverState.Store(int32(http.StateNew))
	return c
}

// errRefused: what Go's server reads once the connection was refused; a read OpError, which
// it closes the connection on without an answer of its own.
var errRefused = &net.OpError{Op: "read", Net: "tcp", Err: fmt.Errorf("request refused: its requestFraming is invalid")}

func (c *framedConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for c.fault == nil {
		n, err := c.Conn.Read(p)
		kept := 0
		if n > 0 {
			kept = c.scan(p[:n])
			if c.headEnded {
				c.headEnded = false
				c.headWrites = c.writes.Load()
			}
		}
		if kept > 0 {
			if c.fault != nil {
				err = nil // the refusal is the next read's
			}
			return kept, err
		}
		if c.fault == nil && err != nil {
			return 0, err
		}
	}
	return c.refuseRead(p)
}

func (c *framedConn) refuseRead(p []byte) (int, error) {
	inHead := c.state < sBody && !c.trailer
	if inHead && http.ConnState(c.serverState.Load()) == http.StateActive && !c.answered {
		// The server's background read while the previous request's answer is under way:
		// the refusal follows that answer. Go ends this read (a deadline in the past) when
		// the answer is done; until then, what the client sends after its fault is dropped.
		for {
			if _, err := c.Conn.Read(p); err != nil {
				return 0, err
			}
		}
	}
	if !c.answered {
		c.answered = true
		if inHead || c.writes.Load() == c.headWrites {
			c.answer(c.fault)
		}
	}
	return 0, errRefused
}

// answer writes the refusal, then closes the connection's sending side and drops what the
// client still sends (a bounded while), so that the client reads the answer rather than a
// reset.
func (c *framedConn) answer(bad *fault) {
	c.refused.Store(true)
	message, _ := json.Marshal(bad.message)
	body := fmt.Sprintf(`{"error":{"message":%s,"type":%q,"param":null,"code":%d}}`, message, bad.kind, bad.status)
	head := "HTTP/1.1 " + strconv.Itoa(bad.status) + " " + http.StatusText(bad.status) +
		"\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) +
		"\r\nConnection: close\r\n\r\n"
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Conn.Write([]byte(head + body)); err != nil {
		return
	}
	if closer, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		_ = closer.CloseWrite()
	}
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	scratch := make([]byte, 16<<10)
	for dropped := 0; dropped < 1<<20; {
		n, err := c.Conn.Read(scratch)
		if err != nil {
			break
		}
		dropped += n
	}
}

const continueLine = "HTTP/1.1 100 Continue\r\n\r\n"

func (c *framedConn) Write(b []byte) (int, error) {
	if c.refused.Load() {
		return 0, errRefusedWrite // the client has its answer: the refusal
	}
	if len(b) != len(continueLine) || string(b) != continueLine {
		c.writes.Add(1)
	}
	return c.Conn.Write(b)
}

var errRefusedWrite = &net.OpError{Op: "write", Net: "tcp", Err: fmt.Errorf("request refused: its requestFraming is invalid")}

// CloseWrite: Go's server half-closes a connection it refuses (closeWriteAndWait).
func (c *framedConn) CloseWrite() error {
	if closer, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return closer.CloseWrite()
	}
	return nil
}

// trackServerState is the client server's ConnState.
func trackServerState(conn net.Conn, state http.ConnState) {
	if c, ok := conn.(*framedConn); ok {
		c.serverState.Store(int32(state))
	}
}

// framedListener hands out framedConns.
type framedListener struct {
	net.Listener
	maxBody int64 // -max-body-bytes: Expect: 100-continue with more is answered 413 at once
}

func (l framedListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newFramedConn(conn, l.maxBody), nil
}
