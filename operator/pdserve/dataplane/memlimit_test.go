package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestTheHeapLimitIsAShareOfTheContainersMemoryLimit(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	limited := write("v2", "536870912\n")          // 512 MiB
	unlimited := write("v2-max", "max\n")          // cgroup v2 without a limit
	v1None := write("v1", "9223372036854771712\n") // cgroup v1 without a limit
	missing := filepath.Join(dir, "absent")
	for _, c := range []struct {
		files []string
		want  int64
	}{
		{[]string{limited}, 536870912 / 100 * 40},
		{[]string{missing, limited}, 536870912 / 100 * 40}, // v1's file when v2's is absent
		{[]string{unlimited, limited}, 0},                  // the first file that exists says
		{[]string{v1None}, 0},
		{[]string{missing}, 0},
	} {
		if got := heapLimit(c.files, 40); got != c.want {
			t.Errorf("%v: %d, want %d", c.files, got, c.want)
		}
	}
	if heapLimit([]string{limited}, 0) != 0 {
		t.Error("a share of 0 sets no limit")
	}
}
