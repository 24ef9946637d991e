"""``key=value`` settings as the command lines take them: any well-formed spec reads back as written, whatever its
spacing; a malformed item or a repeated key is refused with a message naming the spec."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexicache.setting_specs import parse_boolean, parse_settings, parse_value

KEYS = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
VALUES = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(),
                   st.floats(allow_nan=False, allow_infinity=False, width=32).filter(lambda x: not x.is_integer()),
                   st.from_regex(r"[a-z][a-z0-9_.]{0,8}", fullmatch=True).filter(
                       lambda text: text not in ("true", "false", "none") and not text.startswith(("inf", "nan"))))
SPACES = st.sampled_from(["", " ", "  "])


def written(value: object) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@given(st.dictionaries(KEYS, VALUES, max_size=6), st.data())
def test_a_spec_reads_back_as_written_whatever_its_spacing(settings, data):
    items = [f"{data.draw(SPACES)}{key}{data.draw(SPACES)}={data.draw(SPACES)}{written(value)}{data.draw(SPACES)}"
             for key, value in settings.items()]
    parsed = parse_settings(",".join(items), "spec", "a=1")
    assert parsed == settings and list(parsed) == list(settings)  # values, types and order kept
    assert all(type(parsed[key]) is type(value) for key, value in settings.items())


@given(KEYS, VALUES, VALUES)
def test_a_key_given_twice_is_refused(key, first, second):
    with pytest.raises(ValueError, match=f"system 'x': {key} is given twice"):
        parse_settings(f"{key}={written(first)}, {key}={written(second)}", "system 'x'", "a=1")


@pytest.mark.parametrize("spec", ["page_size", "=8", " = 8", "page_size=8,budget"])
def test_an_item_that_is_not_key_value_is_refused_with_an_example(spec):
    with pytest.raises(ValueError, match=r"method spec: .* is not key=value \(e\.g\. budget=256\)"):
        parse_settings(spec, "method spec", "budget=256")


def test_values_and_booleans():
    assert [parse_value(text) for text in ("8", "0.5", "TRUE", "False", "None", "max")] == [8, 0.5, True, False, None,
                                                                                           "max"]
    assert parse_boolean("True") is True and parse_boolean("false") is False
    with pytest.raises(ValueError, match="expected true or false"):
        parse_boolean("yes")
