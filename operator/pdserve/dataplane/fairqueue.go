package main

// This gateway replica's fair prefill admission queue, run here so that a long prompt the data
// plane serves costs no round trip to the Python gateway (the same rules as
// pdserve/gateway/fairqueue.py, which runs the queue of a gateway without a data plane): at most
// `limit` long prefills in flight on each prefill replica; a long prompt names the replicas it
// may use (best first), waits first come first served until one of them has room and is granted
// that one; one whose replicas are all busy does not hold back a later one that may use another;
// one that has waited `maxWait` goes anyway on its first choice, so documents cannot starve.
//
// The Python gateway's own long requests, and its peers' while it is their admission leader,
// wait in this same queue (asked for over the admission channel: admission.go), so one process
// decides and the limit is exact. `others` counts the long prefills the peer replicas hold on
// their own (only while they cannot reach a leader), as the Python gateway reports them.

import (
	"context"
	"sync"
	"time"
)

type admissionSettings struct {
	limit   int           // long prefills in flight per prefill replica
	maxWait time.Duration // then admitted anyway, on the first choice
	others  map[string]int
}

type queuedPrompt struct {
	since    time.Time
	replicas []string
	granted  chan string // buffered: the grant never waits for the asker
	done     bool        // granted (guarded by the queue's mu)
}

type fairQueue struct {
	mu       sync.Mutex
	settings admissionSettings
	inFlight map[string]int // long prefills granted here, per prefill replica
	queue    []*queuedPrompt
	aged     int64
	clock    func() time.Time
}

func newFairQueue() *fairQueue {
	return &fairQueue{inFlight: map[string]int{}, clock: time.Now,
		settings: admissionSettings{limit: 1, maxWait: 10 * time.Second}}
}

// configure takes the Python gateway's settings and its peers' counts (each table push); room
// they made is granted at once.
func (q *fairQueue) configure(s admissionSettings) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.settings = s
	q.wake()
}

// acquire waits for a slot on one of `replicas` (best first) and returns it with the function
// that gives it back (once; later calls do nothing). An error only when ctx ended first.
func (q *fairQueue) acquire(ctx context.Context, replicas []string) (string, func(), error) {
	return q.wait(ctx, q.enqueue(replicas))
}

// enqueue takes a place in the queue now (the order asks arrived in is the order they wait in).
func (q *fairQueue) enqueue(replicas []string) *queuedPrompt {
	waiter := &queuedPrompt{since: q.clock(), replicas: replicas, granted: make(chan string, 1)}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.queue = append(q.queue, waiter)
	q.wake() // granted at once if none of those before it can use a free replica
	return waiter
}

// wait for an enqueued prompt's grant.
func (q *fairQueue) wait(ctx context.Context, waiter *queuedPrompt) (string, func(), error) {
	select {
	case url := <-waiter.granted:
		return url, q.releaser(url), nil
	default:
	}
	q.mu.Lock()
	maxWait := q.settings.maxWait - q.clock().Sub(waiter.since)
	q.mu.Unlock()
	aging := time.NewTimer(maxWait)
	defer aging.Stop()
	select {
	case url := <-waiter.granted:
		return url, q.releaser(url), nil
	case <-aging.C:
		q.mu.Lock()
		if !waiter.done { // waited long enough: go now, on the first choice, even above the limit
			q.remove(waiter)
			q.aged++
			q.grant(waiter, waiter.replicas[0])
		}
		q.mu.Unlock()
		url := <-waiter.granted
		return url, q.releaser(url), nil
	case <-ctx.Done():
		q.mu.Lock()
		if waiter.done { // granted as the asker left: it goes back
			q.release(<-waiter.granted)
		} else {
			q.remove(waiter)
		}
		q.mu.Unlock()
		return "", nil, ctx.Err()
	}
}

func (q *fairQueue) releaser(url string) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			q.mu.Lock()
			q.release(url)
			q.mu.Unlock()
		})
	}
}

// release (with mu held) gives a slot back and admits whoever may take it.
func (q *fairQueue) release(url string) {
	if q.inFlight[url]--; q.inFlight[url] <= 0 {
		delete(q.inFlight, url)
	}
	q.wake()
}

// grant (with mu held).
func (q *fairQueue) grant(waiter *queuedPrompt, url string) {
	q.inFlight[url]++
	waiter.done = true
	waiter.granted <- url
}

// remove (with mu held) takes a waiter out of the queue.
func (q *fairQueue) remove(waiter *queuedPrompt) {
	for i, w := range q.queue {
		if w == waiter {
			q.queue = append(q.queue[:i], q.queue[i+1:]...)
			return
		}
	}
}

// wake (with mu held) admits queued prompts, oldest first, while one of their replicas has
// room; each replica's room is counted once per pass.
func (q *fairQueue) wake() {
	if len(q.queue) == 0 {
		return
	}
	room := map[string]int{}
	waiting := q.queue[:0]
	for _, waiter := range q.queue {
		if url, ok := q.free(waiter.replicas, room); ok {
			room[url]--
			q.grant(waiter, url)
		} else {
			waiting = append(waiting, waiter)
		}
	}
	clear(q.queue[len(waiting):]) // no grant is kept alive by the slice's spare room
	q.queue = waiting
}

func (q *fairQueue) free(replicas []string, room map[string]int) (string, bool) {
	for _, url := range replicas {
		left, known := room[url]
		if !known {
			left = q.settings.limit - q.inFlight[url] - q.settings.others[url]
			room[url] = left
		}
		if left > 0 {
			return url, true
		}
	}
	return "", false
}

// admissionState is what the Python gateway reports of this replica's queue (its /admission
// for the peers, its metrics, its planner's backlog).
type admissionState struct {
	Replicas          map[string]int `json:"replicas"`
	Queued            int            `json:"queued"`
	OldestWaitSeconds float64        `json:"oldestWaitSeconds"`
	Aged              int64          `json:"aged"`
	// The long prompts the data plane serves wait here (else: the leader, through the Python
	// gateway); set from the routing table.
	AdmitsHere bool `json:"admitsHere"`
}

// waiting: long prompts queued for a slot now.
func (q *fairQueue) waiting() int {
	if q == nil {
		return 0
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.queue)
}

func (q *fairQueue) state() admissionState {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := admissionState{Replicas: make(map[string]int, len(q.inFlight)), Queued: len(q.queue), Aged: q.aged}
	for url, n := range q.inFlight {
		out.Replicas[url] = n
	}
	if len(q.queue) > 0 {
		out.OldestWaitSeconds = q.clock().Sub(q.queue[0].since).Seconds()
	}
	return out
}
