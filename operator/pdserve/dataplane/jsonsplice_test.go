package main

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"
	"unicode/utf8"
)

func decoded(t *testing.T, raw []byte) map[string]any {
	t.Helper()
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("not JSON: %v: %s", err, raw)
	}
	return out
}

var bodies = []string{
	`{}`,
	` { "model" : "qwen" , "stream" : true } `,
	`{"model":"qwen","messages":[{"role":"user","content":"a \"quoted\" } ] { [ word\\"}],"max_tokens":8}`,
	`{"model":"qwen","messages":[{"role":"user","content":"back\\\\"}],"n":2,"stream":false,"x":null,"y":-1.5e3}`,
	"{\"model\":\"qwen\",\n\t\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"a\":[1,[2,{\"b\":\"}\"}]]}}}],\"kv_transfer_params\":{\"old\":true}}",
	`{"model":"qwen","prompt":"unicode \u00e9 ü 漢字","stop":["\n\n"]}`,
}

func TestTopLevelFindsWhatEncodingJSONFinds(t *testing.T) {
	for _, body := range bodies {
		members, err := topLevel([]byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		want := decoded(t, []byte(body))
		if len(members) != len(want) {
			t.Fatalf("%s: %d members, encoding/json finds %d", body, len(members), len(want))
		}
		for _, m := range members {
			var value any
			if err := json.Unmarshal(m.value, &value); err != nil {
				t.Fatalf("%s: member %s's value %q is not JSON: %v", body, m.key, m.value, err)
			}
			if !reflect.DeepEqual(value, want[m.key]) {
				t.Fatalf("%s: member %s = %v, encoding/json says %v", body, m.key, value, want[m.key])
			}
		}
	}
}

func TestSpliceOverridesAndDropsMembersAndStaysValid(t *testing.T) {
	for _, body := range bodies {
		members, err := topLevel([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		splice(&out, []byte(body), members, prefillDrops, []field{
			{"stream", []byte("false")}, {"max_tokens", []byte("1")},
			{"kv_transfer_params", handoff},
		})
		got := decoded(t, out.Bytes())
		want := decoded(t, []byte(body))
		for key := range prefillDrops {
			delete(want, key)
		}
		want["stream"], want["max_tokens"] = false, float64(1)
		want["kv_transfer_params"] = decoded(t, handoff)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s:\n got %v\nwant %v", body, got, want)
		}
	}
}

func TestTopLevelRefusesWhatIsNotOneObject(t *testing.T) {
	for _, body := range []string{
		``, `[]`, `"text"`, `{`, `{"a"}`, `{"a":}`, `{"a":1,}`, `{"a":1}{"b":2}`, `{"a":"unterminated}`,
		`{"a":[1,2}`, `{a:1}`, `{"a":1 "b":2}`, `{"a":1} x`,
	} {
		if _, err := topLevel([]byte(body)); err == nil {
			t.Errorf("%q was accepted", body)
		}
	}
}

func TestDuplicatedKeysAreFound(t *testing.T) {
	for body, want := range map[string]bool{
		`{"model":"a","stream":true,"model":"b"}`: true, `{"model":"a","stream":true}`: false, `{}`: false,
	} {
		members, err := topLevel([]byte(body))
		if err != nil || duplicated(members) != want {
			t.Errorf("%s: duplicated %v (%v), want %v", body, duplicated(members), err, want)
		}
	}
}

func FuzzTopLevelNeverPanicsAndAgreesOnObjects(f *testing.F) {
	for _, body := range bodies {
		f.Add([]byte(body))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		members, err := topLevel(body)
		var want map[string]any
		if json.Unmarshal(body, &want) != nil || want == nil || err != nil || !utf8.Valid(body) {
			return // not an object, or one it refuses: the Python gateway answers it
		}
		keys := map[string]bool{}
		for _, m := range members {
			keys[m.key] = true
		}
		for key := range want {
			if !keys[key] && !bytes.Contains(body, []byte(`\`)) {
				t.Fatalf("%q: member %q not found", body, key)
			}
		}
	})
}

// What reading render's answer costs the render route per request: a 50,000-token prompt's
// generate request walked for its members (jsonValue and topLevel each walk it once).
func BenchmarkWalkingARenderAnswerOf50000TokenIds(b *testing.B) {
	ids := make([]int64, 50_000)
	for i := range ids {
		ids[i] = int64(i*7919) % 151_936
	}
	tokens, _ := json.Marshal(ids)
	answer := []byte(`{"request_id":"chatcmpl-1","token_ids":` + string(tokens) +
		`,"sampling_params":{"max_tokens":8,"n":1},"model":"m","stream":false}`)
	b.SetBytes(int64(len(answer)))
	b.ResetTimer()
	for range b.N {
		members, err := topLevel(answer)
		if err != nil || len(lookup(members, "token_ids")) != len(tokens) {
			b.Fatal("not walked", err)
		}
	}
}
