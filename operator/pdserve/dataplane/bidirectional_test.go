package main

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"
)

// bidirectionalCases is testdata/bidirectional_cases.json, which the Python gateway's tests
// read too (tests/unit/gateway/test_bidirectional_cases.py).
type bidirectionalCases struct {
	ReuseBodies []struct {
		Name      string          `json:"name"`
		Held      json.RawMessage `json:"held"`
		Matched   int             `json:"matched"`
		BlockSize int             `json:"blockSize"`
		Want      json.RawMessage `json:"want"`
	} `json:"reuseBodies"`
	Reuse []struct {
		Name string `json:"name"`
		Held *struct {
			Tokens  []int64 `json:"tokens"`
			Expired bool    `json:"expired"`
		} `json:"held"`
		Prompt    []int64 `json:"prompt"`
		MinTokens int     `json:"minTokens"`
		Want      struct {
			Outcome string `json:"outcome"`
			Matched int    `json:"matched"`
		} `json:"want"`
	} `json:"reuse"`
	Room []struct {
		Name      string  `json:"name"`
		Fraction  float64 `json:"fraction"`
		Replicas  int     `json:"replicas"`
		BlockSize int     `json:"blockSize"`
		Decodes   []struct {
			Key       string `json:"key"`
			URL       string `json:"url"`
			Blocks    int    `json:"blocks"`
			BlockSize int    `json:"blockSize"`
		} `json:"decodes"`
		Held      map[string]int `json:"held"`
		Elsewhere map[string]int `json:"elsewhere"`
		Pending   int            `json:"pending"`
		Tokens    int            `json:"tokens"`
		Want      []string       `json:"want"`
	} `json:"room"`
}

func TestPrefillIsPointedAtDecodesHeldKVAsTheSharedCaseSays(t *testing.T) {
	for _, c := range sharedCases[bidirectionalCases](t, "bidirectional_cases.json").ReuseBodies {
		t.Run(c.Name, func(t *testing.T) {
			got, err := reuseParams(c.Held, c.Matched, c.BlockSize)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(parsed(t, got), parsed(t, c.Want)) {
				t.Fatalf("reuse params\n got %s\nwant %s", got, c.Want)
			}
		})
	}
}

func TestATurnIsReusedAsTheSharedCaseSays(t *testing.T) {
	for _, c := range sharedCases[bidirectionalCases](t, "bidirectional_cases.json").Reuse {
		t.Run(c.Name, func(t *testing.T) {
			now := time.Unix(1000, 0)
			store := &turnStore{now: func() time.Time { return now }}
			if c.Held != nil {
				ttl := time.Minute
				if c.Held.Expired {
					ttl = 0
				}
				store.keep("c-1", heldTurn{params: []byte(`{"remote_request_id":"t"}`),
					tokens: c.Held.Tokens, requestID: "t"}, ttl, 10)
			}
			_, outcome, matched := store.reuse("c-1", c.Prompt, c.MinTokens)
			if outcome != c.Want.Outcome || matched != c.Want.Matched {
				t.Fatalf("got %s (%d matched), want %s (%d)", outcome, matched, c.Want.Outcome, c.Want.Matched)
			}
			if c.Want.Outcome == "expired" { // forgotten: the next turn finds none
				if _, again, _ := store.reuse("c-1", c.Prompt, c.MinTokens); again != "none" {
					t.Fatalf("an expired turn asked again: %s, want none", again)
				}
			}
		})
	}
}

func TestAHoldFitsTheDecodeEnginesTheSharedCaseSays(t *testing.T) {
	for _, c := range sharedCases[bidirectionalCases](t, "bidirectional_cases.json").Room {
		t.Run(c.Name, func(t *testing.T) {
			b := &bidirectionalJSON{TTLSeconds: 60, Fraction: c.Fraction, GatewayReplicas: c.Replicas,
				Capacity: map[string]kvCapacity{}, HeldElsewhere: c.Elsewhere}
			var decodes []*endpoint
			for _, d := range c.Decodes {
				decodes = append(decodes, &endpoint{url: d.URL, key: d.Key})
				b.Capacity[d.Key] = kvCapacity{Blocks: d.Blocks, BlockSize: d.BlockSize}
			}
			holds := &holdStore{}
			for url, blocks := range c.Held {
				holds.settle("held-"+url, url, []int{blocks}, 1, b)
			}
			holds.inflight, holds.pending = map[string]int{"decoding": c.Pending}, c.Pending
			var got []string
			for _, e := range holds.room(b, c.BlockSize, decodes, c.Tokens, "") {
				got = append(got, e.key)
			}
			if !reflect.DeepEqual(got, c.Want) {
				t.Fatalf("fits %v, want %v", got, c.Want)
			}
		})
	}
}

// A hold is counted from the answer to the TTL, reserved while its request decodes, freed when
// a next turn read it back, and a turn read back is never pointed at again.
func TestHoldsLastTheTTLUnlessReadBackAndAReadTurnIsNotReusedTwice(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	b := &bidirectionalJSON{TTLSeconds: 10, Fraction: 1, GatewayReplicas: 1,
		Capacity: map[string]kvCapacity{"http://d": {Blocks: 10, BlockSize: 16}}}
	decode := []*endpoint{{url: "http://d", key: "http://d"}}
	holds := &holdStore{now: clock}
	if fits := holds.room(b, 16, decode, 96, "r1"); len(fits) != 1 { // 6 blocks reserved
		t.Fatalf("an empty engine has room: %v", fits)
	}
	if fits := holds.room(b, 16, decode, 96, ""); len(fits) != 0 {
		t.Fatalf("6 reserved + 6 more fit 10 blocks: %v", fits)
	}
	holds.settle("r1", "http://d", []int{80}, 16, b) // 5 blocks held
	if got := holds.snapshot(); got["http://d"] != 5 || holds.pending != 0 {
		t.Fatalf("held %v, pending %d; want 5 held, none pending", got, holds.pending)
	}
	now = now.Add(9 * time.Second)
	if fits := holds.room(b, 16, decode, 96, ""); len(fits) != 0 {
		t.Fatalf("5 held + 6 fit 10 blocks: %v", fits)
	}
	holds.released("http://d", "r1")
	if fits := holds.room(b, 16, decode, 96, ""); len(fits) != 1 {
		t.Fatalf("a hold read back still counts: %v", holds.snapshot())
	}
	holds.settle("r2", "http://d", []int{80}, 16, b)
	now = now.Add(10 * time.Second)
	if got := holds.snapshot(); len(got) != 0 {
		t.Fatalf("holds past the TTL still counted: %v", got)
	}

	turns := &turnStore{now: clock}
	turns.keep("c-1", heldTurn{params: []byte(`{}`), tokens: []int64{1, 2, 3, 4}, requestID: "r2"}, time.Minute, 10)
	turns.consumed("c-1", "other")
	if _, outcome, _ := turns.reuse("c-1", []int64{1, 2, 3, 4, 5}, 2); outcome != "reused" {
		t.Fatalf("another request's read freed this turn: %s", outcome)
	}
	turns.consumed("c-1", "r2")
	if _, outcome, _ := turns.reuse("c-1", []int64{1, 2, 3, 4, 5}, 2); outcome != "none" {
		t.Fatalf("a turn read back is offered again: %s", outcome)
	}
}

func TestATableWithBidirectionalKVNamesWhatIsWrong(t *testing.T) {
	for name, raw := range map[string]string{
		"fraction over 1": `{"fraction":1.5}`, "negative ttl": `{"ttlSeconds":-1}`,
		"negative capacity": `{"capacity":{"http://d":{"blocks":-1}}}`,
	} {
		t.Run(name, func(t *testing.T) {
			table := `{"version":1,"models":{"m":{"route":"pd","blockSize":16,"render":["http://r"],` +
				`"groups":[{"prefill":["http://p"],"decode":["http://d"]}],"bidirectional":` + raw + `}}}`
			if _, _, err := build([]byte(table), nil); err == nil {
				t.Fatalf("accepted %s", raw)
			}
		})
	}
	noBlocks := `{"version":1,"models":{"m":{"route":"pd","render":["http://r"],` +
		`"groups":[{"prefill":["http://p"],"decode":["http://d"]}],"bidirectional":{"fraction":0.5}}}}`
	if _, _, err := build([]byte(noBlocks), nil); err == nil {
		t.Fatal("accepted bidirectional KV without a block size")
	}
}

// FuzzReuseParams: decode's kv_transfer_params and a prompt's token ids come from peers. Held
// params the data plane keeps are objects; whatever their members hold, the prefill's params
// are one JSON object, or an error, never a panic.
func FuzzReuseParams(f *testing.F) {
	f.Add([]byte(`{"remote_block_ids":[1,2,3],"remote_num_tokens":40}`), 33, 16)
	f.Add([]byte(`{"remote_block_ids":[[1,2],[3]],"remote_num_tokens":1e3}`), 500, 16)
	f.Add([]byte(`{"remote_block_ids":[[1,2],3],"remote_num_tokens":"x"}`), 64, 16)
	f.Add([]byte(`{"remote_block_ids":{},"remote_num_tokens":-5}`), 64, 1)
	f.Fuzz(func(t *testing.T, held []byte, matched, blockSize int) {
		if blockSize <= 0 || matched < 0 {
			return
		}
		if _, err := topLevel(held); err != nil {
			return // never kept: decode's answer's params are kept only as an object
		}
		got, err := reuseParams(held, matched, blockSize)
		if err != nil {
			return
		}
		var value map[string]any
		if !json.Valid(got) || json.Unmarshal(got, &value) != nil {
			if json.Valid(held) {
				t.Fatalf("valid params %s became %s", held, got)
			}
		}
		if _, ok := tokenIDs(held); ok && held[0] != '[' {
			t.Fatalf("an object read as token ids: %s", held)
		}
	})
}
