"""The data plane's own Go tests (the JSON splicer, the routing table, picking, the API keys,
the fuzz targets' seed corpora) under the race detector and as the product is built (raw
socket calls, which race builds replace with Go's own), and the Go code's gofmt, go vet and
staticcheck (devtools/golint.py), run here so `make test` runs them too."""

from __future__ import annotations

from devtools.golint import plain_tests, problems, race_tests


def test_the_data_plane_go_tests_pass_under_the_race_detector() -> None:
    done = race_tests()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ok" in done.stdout


def test_the_data_plane_go_tests_pass_on_the_raw_socket_calls_the_product_runs() -> None:
    done = plain_tests()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ok" in done.stdout


def test_the_go_code_is_gofmt_vet_and_staticcheck_clean() -> None:
    found = problems()
    assert not found, "\n".join(found)
