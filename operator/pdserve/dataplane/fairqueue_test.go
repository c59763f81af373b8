package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

func queueWith(limit int, maxWait time.Duration, others map[string]int) *fairQueue {
	q := newFairQueue()
	q.configure(admissionSettings{limit: limit, maxWait: maxWait, others: others})
	return q
}

type grant struct {
	url     string
	release func()
	err     error
}

// ask starts an acquire and returns where its answer comes.
func ask(ctx context.Context, q *fairQueue, replicas ...string) <-chan grant {
	out := make(chan grant, 1)
	go func() {
		url, release, err := q.acquire(ctx, replicas)
		out <- grant{url, release, err}
	}()
	return out
}

func answer(t *testing.T, from <-chan grant) grant {
	t.Helper()
	select {
	case g := <-from:
		return g
	case <-time.After(5 * time.Second):
		t.Fatal("no grant within 5 s")
		return grant{}
	}
}

// notYet: a waiter the queue holds (queuedCount said so) has no grant: grants are given under
// the queue's lock, as waiters leave it.
func notYet(t *testing.T, from <-chan grant) {
	t.Helper()
	select {
	case g := <-from:
		t.Fatalf("granted %q, expected it to wait", g.url)
	default:
	}
}

// queuedCount polls until the queue holds n waiters (acquire runs in its own goroutine).
func queuedCount(t *testing.T, q *fairQueue, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for q.state().Queued != n {
		if time.Now().After(deadline) {
			t.Fatalf("queued %d, expected %d", q.state().Queued, n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestLongPromptsTakeTurnsPerReplicaFirstComeFirstServed(t *testing.T) {
	q := queueWith(1, time.Minute, nil)
	ctx := context.Background()
	first := answer(t, ask(ctx, q, "http://p0", "http://p1"))
	if first.url != "http://p0" {
		t.Fatalf("granted %q, expected the first choice", first.url)
	}
	second := ask(ctx, q, "http://p0")
	queuedCount(t, q, 1)
	third := ask(ctx, q, "http://p0")
	queuedCount(t, q, 2)
	// p0 is busy, but a later prompt that may use p1 does not wait behind them.
	if other := answer(t, ask(ctx, q, "http://p0", "http://p1")); other.url != "http://p1" {
		t.Fatalf("granted %q, expected the free second choice", other.url)
	}
	queuedCount(t, q, 2)
	notYet(t, second)
	first.release()
	first.release() // once only: a second call gives nothing back twice
	if got := answer(t, second); got.url != "http://p0" {
		t.Fatalf("granted %q", got.url)
	}
	queuedCount(t, q, 1)
	notYet(t, third)
	if s := q.state(); s.Replicas["http://p0"] != 1 || s.Replicas["http://p1"] != 1 || s.Queued != 1 {
		t.Fatalf("state %+v", s)
	}
}

func TestAPromptThatWaitedMaxWaitGoesAnywayOnItsFirstChoice(t *testing.T) {
	q := queueWith(1, 30*time.Millisecond, nil)
	ctx := context.Background()
	held := answer(t, ask(ctx, q, "http://p0"))
	late := answer(t, ask(ctx, q, "http://p0"))
	if late.url != "http://p0" || q.state().Aged != 1 {
		t.Fatalf("granted %q, aged %d", late.url, q.state().Aged)
	}
	held.release()
	late.release()
	if s := q.state(); len(s.Replicas) != 0 {
		t.Fatalf("slots left held: %+v", s.Replicas)
	}
}

func TestAnAskerThatLeavesWhileQueuedIsNeverGranted(t *testing.T) {
	q := queueWith(1, time.Minute, nil)
	held := answer(t, ask(context.Background(), q, "http://p0"))
	ctx, cancel := context.WithCancel(context.Background())
	gone := ask(ctx, q, "http://p0")
	queuedCount(t, q, 1)
	cancel()
	if g := answer(t, gone); !errors.Is(g.err, context.Canceled) {
		t.Fatalf("expected the cancellation, got %+v", g)
	}
	queuedCount(t, q, 0)
	held.release()
	next := answer(t, ask(context.Background(), q, "http://p0"))
	if s := q.state(); next.url != "http://p0" || s.Replicas["http://p0"] != 1 {
		t.Fatalf("granted %q with %+v", next.url, s.Replicas)
	}
}

func TestPeersLongPrefillsCountAgainstTheLimitAndTheirReleaseAdmits(t *testing.T) {
	q := queueWith(2, time.Minute, map[string]int{"http://p0": 2})
	waiting := ask(context.Background(), q, "http://p0")
	queuedCount(t, q, 1)
	notYet(t, waiting)
	q.configure(admissionSettings{limit: 2, maxWait: time.Minute, others: map[string]int{"http://p0": 1}})
	if g := answer(t, waiting); g.url != "http://p0" {
		t.Fatalf("granted %q", g.url)
	}
}

// pythonSide is the Python gateway's end of the admission channel: it accepts the data plane's
// connection and speaks lines.
type pythonSide struct {
	conn  net.Conn
	lines *bufio.Scanner
}

func connectedChannel(t *testing.T, q *fairQueue, holdFor time.Duration) (*admissionChannel, *pythonSide) {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { listener.Close() })
	a := newAdmissionChannel(listener.Addr().String(), "t0ken", q, holdFor)
	go a.keepConnected(10 * time.Millisecond)
	conn, err := listener.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	side := &pythonSide{conn: conn, lines: bufio.NewScanner(conn)}
	if hello := side.line(t); hello != "hello t0ken" {
		t.Fatalf("first line %q", hello)
	}
	return a, side
}

func (s *pythonSide) line(t *testing.T) string {
	t.Helper()
	_ = s.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if !s.lines.Scan() {
		t.Fatalf("no line: %v", s.lines.Err())
	}
	return s.lines.Text()
}

func (s *pythonSide) say(t *testing.T, lines ...string) {
	t.Helper()
	if _, err := s.conn.Write([]byte(strings.Join(lines, "\n") + "\n")); err != nil {
		t.Fatal(err)
	}
}

func TestThePythonGatewaysLongRequestsWaitInTheSameQueue(t *testing.T) {
	q := queueWith(1, time.Minute, nil)
	_, python := connectedChannel(t, q, time.Minute)
	own := answer(t, ask(context.Background(), q, "http://p0"))
	python.say(t, "acquire a http://p0", "acquire b http://p1 http://p0")
	if got := python.line(t); got != "granted b http://p1" {
		t.Fatalf("got %q: b may use the free p1", got)
	}
	queuedCount(t, q, 1) // a waits behind the data plane's own prompt on p0
	own.release()
	if got := python.line(t); got != "granted a http://p0" {
		t.Fatalf("got %q", got)
	}
	python.say(t, "release a", "release b")
	deadline := time.Now().Add(5 * time.Second)
	for len(q.state().Replicas) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("slots left held: %+v", q.state().Replicas)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestSlotsHeldForThePythonGatewayGoBackWhenItsConnectionCloses(t *testing.T) {
	q := queueWith(1, time.Minute, nil)
	_, python := connectedChannel(t, q, time.Minute)
	python.say(t, "acquire a http://p0", "acquire b http://p0")
	if got := python.line(t); got != "granted a http://p0" {
		t.Fatalf("got %q", got)
	}
	queuedCount(t, q, 1)
	python.conn.Close()
	if g := answer(t, ask(context.Background(), q, "http://p0")); g.url != "http://p0" {
		t.Fatalf("granted %q", g.url)
	}
	if s := q.state(); s.Replicas["http://p0"] != 1 || s.Queued != 0 {
		t.Fatalf("state %+v: the closed connection's slot and ask should be gone", s)
	}
}

func TestASlotTheDataPlaneAsksForIsGrantedByThePythonGateway(t *testing.T) {
	a, python := connectedChannel(t, newFairQueue(), time.Minute)
	asked := make(chan grant, 1)
	go func() {
		url, release, err := a.acquire(context.Background(), []string{"http://p0", "http://p1"})
		asked <- grant{url, release, err}
	}()
	if got := python.line(t); got != "acquire 1 http://p0 http://p1" {
		t.Fatalf("got %q", got)
	}
	python.say(t, "granted 1 http://p1")
	g := answer(t, asked)
	if g.url != "http://p1" || g.err != nil {
		t.Fatalf("got %+v", g)
	}
	g.release()
	if got := python.line(t); got != "release 1" {
		t.Fatalf("got %q", got)
	}
}

func TestAHoldThePythonGatewayForgetsEndsAfterHoldFor(t *testing.T) {
	q := queueWith(1, time.Minute, nil)
	_, python := connectedChannel(t, q, 30*time.Millisecond)
	python.say(t, "acquire a http://p0")
	if got := python.line(t); got != "granted a http://p0" {
		t.Fatalf("got %q", got)
	}
	if g := answer(t, ask(context.Background(), q, "http://p0")); g.url != "http://p0" {
		t.Fatalf("granted %q", g.url)
	}
}

// While another gateway replica leads admission, a long prompt's slot is asked for through the
// Python gateway; when that cannot be done (its admission connection is down), the prompt is
// admitted in this replica's own queue, as the Python gateway admits when its leader is
// unavailable, and counted as a leader error: served, never handed over.
func TestALongPromptWhoseLeaderCannotBeAskedIsAdmittedHere(t *testing.T) {
	table := `{"version":1,"admission":{"maxLongPerReplica":1,"maxWaitSeconds":5,"leaderElsewhere":true},` +
		`"models":{"m":{"route":"pd","groups":[{"prefill":["URL"],"decode":["URL"]}]}}}`
	u := newPlaneUnderTest(t, table, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"finish_reason":"stop"}],"kv_transfer_params":{"remote_request_id":"x"}}`)
	}, func(p *plane) {
		p.admission = newAdmissionChannel("127.0.0.1:1", testToken, p.queue, time.Second) // never connected
	})
	u.p.queue.configure(u.p.current.Load().admission)
	response, body := u.post(t, chatBody, "X-PDServe-Class", "long")
	if response.StatusCode != 200 {
		t.Fatalf("%d %s", response.StatusCode, body)
	}
	if got := u.p.stats.leaderErrors.Load(); got != 1 {
		t.Fatalf("leader errors %d, want 1", got)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
	if n := requests(u.p, routePD, "ok"); n != 1 {
		t.Fatalf("served P/D %d times, want 1", n)
	}
}
