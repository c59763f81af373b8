"""A request the data plane hands over after spending time on it keeps its deadline: the Python
gateway's request timeout runs from the client's first byte, not from the hand-over. Only the
data plane's own word counts: a client cannot buy itself time by sending the header."""

from __future__ import annotations

import pytest

from pdserve.gateway.dataplane import (
    ELAPSED_HEADER,
    TOKEN_HEADER,
    DataPlane,
    spent_in_data_plane,
)

TOKEN = "0123456789abcdef"


def plane() -> DataPlane:
    data_plane = DataPlane.__new__(DataPlane)  # only its token is read
    data_plane.token = TOKEN
    return data_plane


def test_the_time_the_data_plane_spent_counts_against_the_request_timeout() -> None:
    headers = {ELAPSED_HEADER: "1500", TOKEN_HEADER: TOKEN}
    assert spent_in_data_plane(headers, plane()) == 1.5


@pytest.mark.parametrize(
    "headers",
    [
        {ELAPSED_HEADER: "1500"},  # a client's own header, without the token
        {ELAPSED_HEADER: "1500", TOKEN_HEADER: "guessed"},
        {ELAPSED_HEADER: "-600000", TOKEN_HEADER: TOKEN},  # never a longer deadline
        {ELAPSED_HEADER: "nan", TOKEN_HEADER: TOKEN},
        {ELAPSED_HEADER: "soon", TOKEN_HEADER: TOKEN},
        {},
    ],
    ids=["no token", "wrong token", "negative", "nan", "not a number", "none"],
)
def test_anything_but_the_data_planes_own_word_is_no_time_spent(headers: dict[str, str]) -> None:
    assert spent_in_data_plane(headers, plane()) == 0.0


def test_without_a_data_plane_the_header_means_nothing() -> None:
    assert spent_in_data_plane({ELAPSED_HEADER: "1500", TOKEN_HEADER: TOKEN}, None) == 0.0
