"""SPEC §7: scrub and redact; no 8-character piece of a secret's echo survives."""

from __future__ import annotations

import json

from hypothesis import assume, given
from hypothesis import strategies as st

from trialledger.core import redact, scrub
from trialledger.core.redact import header_secrets, scrub_data

SECRET = "sk-proj-4f9a8b7c6d5e"
R = "[redacted]"


def test_whole_value() -> None:
    assert scrub(f"key={SECRET}; next", [SECRET]) == f"key={R}; next"


def test_json_escaped_both_ways() -> None:
    secret = 'p"ss\\wörd-123456'
    ascii_form = json.dumps(secret)[1:-1]
    unicode_form = json.dumps(secret, ensure_ascii=False)[1:-1]
    assert ascii_form != unicode_form
    assert scrub(f"a {ascii_form} b {unicode_form} c", [secret]) == f"a {R} b {R} c"


def test_cut_at_the_end() -> None:
    assert scrub(f"error body: {SECRET[:11]}", [SECRET]) == f"error body: {R}"


def test_cut_followed_by_more_text() -> None:
    assert scrub(f"x {SECRET[:9]}... (truncated)", [SECRET]) == f"x {R}... (truncated)"


def test_multiword_cut() -> None:
    secret = "correct horse battery staple"
    assert scrub("header: correct horse bat…", [secret]) == f"header: {R}…"


def test_cut_echo_followed_directly_by_a_full_copy() -> None:
    assert scrub(f"[{SECRET[:10]}{SECRET}]", [SECRET]) == f"[{R}]"


def test_two_values_sharing_a_start() -> None:
    a, b = "shared-prefix-AAAA", "shared-prefix-BBBB"
    assert scrub(f"{a} {b} shared-prefix-C", [a, b]) == f"{R} {R} {R}C"
    assert scrub(f"{a}{b}", [a, b]) == R


def test_value_whose_start_repeats() -> None:
    secret = "aaaaaaaabbbbcccc"
    assert scrub("a" + secret + "!", [secret]) == R + "!"


def test_bearer_value_echoed_without_its_scheme() -> None:
    secrets = header_secrets("Bearer tok-0123456789abcdef")
    assert scrub("auth failed for tok-0123456789abcdef", secrets) == f"auth failed for {R}"
    assert header_secrets("Basic dXNlcjpwYXNz")[1] == "dXNlcjpwYXNz"
    assert header_secrets("token abc")[1] == "abc"


def test_values_shorter_than_eight_match_only_whole() -> None:
    assert scrub("infra infr inf", ["infra"]) == f"{R} infr inf"


def test_seven_character_prefix_of_a_long_value_is_not_a_match() -> None:
    assert scrub(f"{SECRET[:7]} ok", [SECRET]) == f"{SECRET[:7]} ok"


def test_redact_caps_lines_and_keeps_the_last_2000() -> None:
    long_line = "x" * 600
    assert redact(long_line, []) == "x" * 499 + "…"
    text = "\n".join(f"line {i:04d}" for i in range(1000))
    out = redact(text, [])
    assert len(out) == 2000 and out.endswith("line 0999")


def test_secret_at_the_cut_point_is_scrubbed_before_cutting() -> None:
    body = ("b" * 99 + "\n") * 20
    text = "x" * 50 + SECRET + body[15:]  # the last 2,000 characters start inside the secret
    assert len(text) - 2000 < 50 + len(SECRET)
    out = redact(text, [SECRET])
    assert len(out) == 2000
    assert not any(SECRET[i:i + 4] in out for i in range(len(SECRET) - 3))


def test_unicode_secret_and_code_points() -> None:
    secret = "пароль-секрет-🔑-42"
    out = redact("é" * 10 + secret + "ü", [secret])
    assert out == "é" * 10 + R + "ü"
    assert redact("é" * 700, []) == "é" * 499 + "…"


def test_scrub_data_reaches_every_string() -> None:
    data = {"a": [SECRET, {"b": f"x{SECRET}"}], SECRET: 1, "n": 5}
    assert scrub_data(data, [SECRET]) == {"a": [R, {"b": f"x{R}"}], R: 1, "n": 5}


secret_text = st.text(
    alphabet=st.characters(blacklist_characters="[]", blacklist_categories=["Cs"]),
    min_size=8, max_size=40,
)


@given(secret=secret_text, before=st.text(max_size=30), after=st.text(max_size=30),
       form=st.sampled_from(["whole", "ascii", "unicode"]), cut=st.integers(0, 40))
def test_no_eight_character_piece_of_an_echo_survives(
    secret: str, before: str, after: str, form: str, cut: int
) -> None:
    echo = {"whole": secret, "ascii": json.dumps(secret)[1:-1],
            "unicode": json.dumps(secret, ensure_ascii=False)[1:-1]}[form]
    echo = echo[: max(8, len(echo) - cut)]
    assume("[" not in echo and "]" not in echo)
    out = scrub(before + echo + after, [secret])
    for i in range(len(echo) - 7):
        piece = echo[i:i + 8]
        assert piece not in out or piece in before or piece in after


@given(text=st.text(max_size=3000), secret=secret_text)
def test_redact_bounds_hold(text: str, secret: str) -> None:
    out = redact(text, [secret])
    assert len(out) <= 2000
    assert all(len(line) <= 500 for line in out.split("\n"))
