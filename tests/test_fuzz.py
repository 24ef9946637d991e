"""Bad input, fuzzed: cache settings, profile files and generate arguments. Every case either runs and gives what
the reference gives (DynamicCache's tokens at a covering budget) or raises an error that names the argument; nothing
the caller passed in is changed."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import dense_cache, left_pad, random_prompt, tiny_config, tiny_model
from hypothesis import event, given
from hypothesis import strategies as st

from flexicache import FlexiCache, HeadProfile

CONFIG = tiny_config(num_layers=2)
MODEL = tiny_model(CONFIG)
PROFILE = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=8, unstable_heads=[(0, 0), (0, 1), (1, 1)],
                      scores=[[0.1, 0.2], [0.3, 0.4]], unstable_fraction=0.75)
PROMPTS = left_pad([random_prompt(21, seed=1), random_prompt(13, seed=2)])
NEW_TOKENS = 6
COVERING = 64  # tokens: more than prompt + new tokens


def generate(cache, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> torch.Tensor:
    return MODEL.generate(ids, attention_mask=mask, past_key_values=cache, **{
        "max_new_tokens": NEW_TOKENS, "do_sample": False, **kwargs})


DENSE = generate(dense_cache(MODEL), *PROMPTS)

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 3000), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=4), st.lists(st.integers(0, 3), max_size=2))


VALID_SETTINGS = {
    "token_budget": st.sampled_from([16, 32, 48, 64, 4096]),
    "page_size": st.sampled_from([4, 8, 16]),
    "rerank_interval": st.integers(1, 5),
    "group_reduce": st.sampled_from(["max", "sum"]),
    "spread_weight": st.floats(0, 1),
    "backend": st.sampled_from(["auto", "reference"]),
    "cuda_graphs": st.booleans(),
    "max_cache_len": st.one_of(st.none(), st.integers(1, 100)),
    "host_dtype": st.sampled_from(["auto", "float8_e4m3fn"]),
    "max_promotions": st.one_of(st.none(), st.integers(1, 8)),
}


@st.composite
def settings_with_one_odd_value(draw) -> tuple[dict, str | None]:
    """Settings from their valid ranges (any subset), and maybe one of them replaced by anything at all."""
    settings = draw(st.fixed_dictionaries({}, optional=VALID_SETTINGS))
    odd = draw(st.one_of(st.none(), st.sampled_from(sorted(VALID_SETTINGS))))
    if odd is not None:
        settings[odd] = draw(ANY)
    return settings, odd


def names_an_argument(error: BaseException, names: list[str]) -> bool:
    return any(name in str(error) for name in names)


@given(settings_with_one_odd_value())
def test_any_settings_either_work_or_are_refused_naming_the_argument(case: tuple[dict, str | None]) -> None:
    """Valid settings may still be refused together (a budget below two pages, or not a multiple of the page
    size): then the message names one of those; an odd value is either fine or refused by its name."""
    settings, odd = case
    passed = copy.deepcopy(settings)
    config, profile = CONFIG.to_dict(), PROFILE.to_dict()
    try:
        cache = FlexiCache.from_model(MODEL, profile=PROFILE, **settings)
    except (ValueError, TypeError, ImportError) as error:
        budget, page = (passed.get(name, default) if name != odd else default
                        for name, default in (("token_budget", 2048), ("page_size", 16)))
        blamed = [odd] if odd is not None else []
        if odd in ("token_budget", "page_size") or budget < 2 * page or budget % page:
            blamed += ["token_budget", "page_size"]  # the two valid values do not go together
        assert names_an_argument(error, blamed), (settings, error)
        event("refused")
        return
    finally:
        assert settings == passed or any(isinstance(v, float) and math.isnan(v) for v in settings.values())
        assert CONFIG.to_dict() == config and PROFILE.to_dict() == profile
    out = generate(cache, *PROMPTS)
    event("ran at a covering budget" if cache.settings.token_budget >= COVERING else "ran sparse")
    if cache.settings.token_budget >= COVERING and cache.settings.host_dtype == "auto":  # float8: rounded KV
        assert torch.equal(out, DENSE), settings
    assert out.shape == DENSE.shape and cache.stats()["decode_steps"] == NEW_TOKENS - 1


def profile_json(data: object) -> str:
    return json.dumps(data, allow_nan=True)


JSON_VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2, 4), st.floats(allow_nan=True),
                                    st.text(max_size=3)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=3), inner, max_size=2)),
                          max_leaves=6)


@st.composite
def profile_file(draw) -> str:
    """The text of a profile file: a valid one, with fields changed, removed or added, or its text damaged."""
    data = PROFILE.to_dict()
    kind = draw(st.sampled_from(["valid", "field", "remove", "add", "heads", "scores", "shape", "text"]))
    if kind == "valid":  # other unstable heads and scores, all in range
        data["unstable_heads"] = draw(st.lists(st.lists(st.integers(0, 1), min_size=2, max_size=2), max_size=4))
        data["scores"] = draw(st.one_of(st.none(), st.lists(st.lists(st.floats(-1, 1), min_size=2, max_size=2),
                                                            min_size=2, max_size=2)))
    elif kind == "field":
        data[draw(st.sampled_from(sorted(data)))] = draw(JSON_VALUE)
    elif kind == "remove":
        del data[draw(st.sampled_from(sorted(data)))]
    elif kind == "add":
        data[draw(st.text(min_size=1, max_size=6))] = draw(JSON_VALUE)
    elif kind == "heads":
        data["unstable_heads"] = draw(st.lists(st.lists(st.one_of(st.integers(-1, 3), JSON_VALUE), max_size=3),
                                               max_size=4))
    elif kind == "scores":
        data["scores"] = draw(st.lists(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), JSON_VALUE),
                                                max_size=3), max_size=3))
    elif kind == "shape":
        data[draw(st.sampled_from(["num_layers", "num_kv_heads", "head_dim"]))] = draw(st.integers(-1, 20))
    text = profile_json(data)
    if kind == "text":
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=4)) + text[cut + draw(st.integers(0, 5)):]
    return text


@given(profile_file())
def test_any_profile_file_either_works_or_is_refused_naming_the_profile(tmp_path_factory, text: str) -> None:
    path = tmp_path_factory.mktemp("profiles") / "flexicache_profile.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        cache = FlexiCache.from_model(MODEL, profile=path, token_budget=COVERING, page_size=4)
    except (ValueError, TypeError) as error:
        assert "profile" in str(error), (text, error)
        event("refused")
        return
    event("ran")
    assert path.read_text(encoding="utf-8", errors="surrogatepass") == text
    assert torch.equal(generate(cache, *PROMPTS), DENSE)


def test_damaged_profile_files_name_the_file_and_the_problem(tmp_path) -> None:
    cases = {
        "truncated": (profile_json(PROFILE.to_dict())[:40], "not a readable FlexiCache HeadProfile"),
        "not an object": ("[1, 2]", "not a readable FlexiCache HeadProfile"),
        "no heads": (profile_json({k: v for k, v in PROFILE.to_dict().items() if k != "unstable_heads"}),
                     "field unstable_heads must be a list of [layer, KV head] pairs"),
        "head triple": (profile_json({**PROFILE.to_dict(), "unstable_heads": [[0, 1, 1]]}), "field unstable_heads"),
        "unknown field": (profile_json({**PROFILE.to_dict(), "colour": 1}), "Unknown HeadProfile fields"),
        "NaN score": (profile_json({**PROFILE.to_dict(), "scores": [[math.nan, 0.1], [0.2, 0.3]]}),
                      "field scores must be finite numbers"),
        "scores shape": (profile_json({**PROFILE.to_dict(), "scores": [[0.1]]}), "2 lists of 2 numbers"),
        "layers as text": (profile_json({**PROFILE.to_dict(), "num_layers": "2"}),
                           "field num_layers must be a positive integer, got '2'"),
        "other model": (profile_json({**PROFILE.to_dict(), "num_layers": 3, "scores": None}),
                        "made for a model with 3 layers"),
        "fraction": (profile_json({**PROFILE.to_dict(), "unstable_fraction": 7}), "unstable_fraction"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="profile") as refused:
            FlexiCache(CONFIG, profile=path)
        assert expected in str(refused.value), (name, refused.value)
    with pytest.raises(TypeError, match="profile must be a HeadProfile"):
        FlexiCache(CONFIG, profile=3)


GENERATE = {
    "max_new_tokens": st.integers(-1, 10),
    "min_new_tokens": st.integers(0, 4),
    "do_sample": st.booleans(),
    "temperature": st.sampled_from([0.5, 1.0, 1.7, 0.0, -1.0]),
    "top_k": st.sampled_from([0, 5, 50]),
    "top_p": st.sampled_from([0.5, 0.9, 1.0, 1.5]),
    "repetition_penalty": st.sampled_from([0.8, 1.0, 1.3]),
    "no_repeat_ngram_size": st.integers(0, 3),
    "num_beams": st.sampled_from([1, 1, 2]),
    "num_return_sequences": st.integers(1, 3),
    "use_cache": st.booleans(),
    "prompt_lookup_num_tokens": st.sampled_from([None, 2]),
    "return_dict_in_generate": st.booleans(),
    "output_scores": st.booleans(),
}
# What FlexiCache refuses where DynamicCache runs, named in its message (use_cache=False: only where transformers
# passes it to the cache, from 5.24).
OUR_REFUSALS = ("num_beams", "use_cache")


def sequences(output) -> torch.Tensor:
    return output.sequences if hasattr(output, "sequences") else output


@given(st.fixed_dictionaries({}, optional=GENERATE), st.integers(1, 2), st.integers(0, 2**16))
def test_any_generate_arguments_either_match_dynamic_cache_or_are_refused_naming_them(kwargs: dict, batch: int,
                                                                                     seed: int) -> None:
    ids, mask = PROMPTS[0][:batch].clone(), PROMPTS[1][:batch].clone()
    passed = copy.deepcopy(kwargs)
    outcomes = []
    for make in (lambda: dense_cache(MODEL), lambda: FlexiCache.from_model(MODEL, profile=PROFILE,
                                                                          token_budget=COVERING, page_size=4)):
        torch.manual_seed(seed)
        try:
            outcomes.append(sequences(generate(make(), ids, mask, **kwargs)))
        except Exception as error:  # compared below
            outcomes.append(error)
        assert torch.equal(ids, PROMPTS[0][:batch]) and torch.equal(mask, PROMPTS[1][:batch]) and kwargs == passed
    dense, ours = outcomes
    event("transformers refused" if isinstance(dense, Exception) else "FlexiCache refused"
          if isinstance(ours, Exception) else "both ran")
    if isinstance(dense, Exception):
        assert type(ours) is type(dense) and str(ours) == str(dense), (kwargs, dense, ours)  # transformers' refusal
    elif isinstance(ours, Exception):
        assert names_an_argument(ours, list(OUR_REFUSALS)) and any(name in kwargs for name in OUR_REFUSALS), (
            kwargs, ours)
    else:
        assert torch.equal(ours, dense), kwargs


def test_use_cache_off_with_a_flexicache_is_refused_where_transformers_says_so() -> None:
    """With ``use_cache=False`` transformers feeds the whole sequence to a passed cache at every step; from 5.24 the
    cache sees the flag and refuses at once, naming it."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip("transformers before 5.24 does not pass use_cache to the cache")
    cache = FlexiCache.from_model(MODEL, profile=PROFILE, token_budget=COVERING, page_size=4)
    with pytest.raises(ValueError, match="use_cache=False with a FlexiCache"):
        generate(cache, *PROMPTS, use_cache=False)
    assert cache.get_seq_length() == 0
    assert torch.equal(generate(cache, *PROMPTS), DENSE)  # nothing was stored: the cache works as new
