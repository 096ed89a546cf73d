"""``kvtool calibrate``: the knapsack, the choice of a per-layer policy, and a real calibration
of the default model (tiny menu, few tokens)."""

from __future__ import annotations

import itertools
import json

import pytest

from kvtool.calibrate import Measurements, choose, knapsack, menu_codec, outlier_channels
from kvtool.errors import KvtoolError
from kvtool.policy import CodecPolicy


def _brute_force(costs, weights, capacity):
    best = None
    for pick in itertools.product(*(range(len(c)) for c in costs)):
        w = sum(weights[g][j] for g, j in enumerate(pick))
        c = sum(costs[g][j] for g, j in enumerate(pick))
        if w <= capacity + 1e-12 and (best is None or c < best[0] - 1e-15):
            best = (c, pick)
    return best


def test_knapsack_finds_the_known_optimum():
    # two sensitive groups deserve the 4 bits; the greedy "cheapest first" would not see it
    costs = [[9.0, 1.0, 0.0], [8.0, 0.5, 0.0], [0.2, 0.1, 0.0], [0.3, 0.2, 0.0]]
    weights = [[2, 3, 4]] * 4
    assert knapsack(costs, weights, 11) == [2, 1, 0, 0]
    assert knapsack(costs, weights, 16) == [2, 2, 2, 2]
    assert knapsack(costs, weights, 8) == [0, 0, 0, 0]


def test_knapsack_matches_brute_force_on_random_instances(rng):
    for _ in range(20):
        groups, items = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        costs = rng.random((groups, items)).tolist()
        weights = (rng.integers(8, 64, (groups, items)) / 16).tolist()  # on the 1/64 grid
        capacity = float(rng.uniform(min(map(min, weights)) * groups,
                                     max(map(max, weights)) * groups))
        want = _brute_force(costs, weights, capacity)
        if want is None:
            with pytest.raises(KvtoolError):
                knapsack(costs, weights, capacity)
            continue
        got = knapsack(costs, weights, capacity)
        assert sum(costs[g][j] for g, j in enumerate(got)) == pytest.approx(want[0])
        assert sum(weights[g][j] for g, j in enumerate(got)) <= capacity + 1e-9


def test_knapsack_refuses_a_budget_below_the_smallest_choice():
    with pytest.raises(KvtoolError, match="below the smallest choice"):
        knapsack([[0.0, 1.0]], [[4.0, 2.0]], 1.5)


def test_knapsack_a_huge_budget_costs_no_memory():
    """A budget beyond every choice's heaviest sum (``--bits 1e9``) picks the least KL at once,
    with no table as large as the budget (it used to allocate groups × budget × 64 cells)."""
    costs = [[0.5, 0.1, 0.0]] * 60
    weights = [[2.0, 4.0, 16.0]] * 60
    for capacity in (16 * 60, 1e9 * 60, 1e300 * 60, float("inf")):
        assert knapsack(costs, weights, capacity) == [2] * 60


def test_outliers_scale_with_head_dim():
    assert [outlier_channels(d) for d in (8, 64, 128, 256)] == [2, 16, 32, 64]
    assert menu_codec("turbomix:outliers={outliers}", "key", 256).get_config()["outliers"] == 64
    assert menu_codec("turbomix", "key", 64).get_config()["center"] is True
    assert menu_codec("turbomix", "value", 64).get_config()["center"] is False


def _measurements(kl) -> Measurements:
    specs = {"2b": "turbomix:bits=2", "4b": "turbomix:bits=4", "lossless": "raw"}
    bits = [[menu_codec(s, r, 64).bits_per_element(64) for s in specs.values()]
            for r in ("key", "value")]
    return Measurements(list(specs), specs, bits, kl, 64, 100, 10, 4, 0.0)


def test_choose_spends_the_bits_where_the_kl_is():
    # layer 1's keys are fragile, everything else is not
    cheap, fragile = [1e-4, 1e-5, 0.0], [5e-2, 1e-4, 0.0]
    m = _measurements([[cheap, cheap], [fragile, cheap], [cheap, cheap]])
    cal = choose(m, 2.6)  # room for one 4-bit role: 5 x 2.25 + 4.25 = 15.5 <= 6 x 2.6
    assert cal.mean_bits <= 2.6
    assert [r["key"] for r in cal.rows] == ["2b", "4b", "2b"]
    assert {r["value"] for r in cal.rows} == {"2b"}
    policy = cal.policy
    assert policy.key.get_config()["bits"] == 2 and policy.num_layers == 3
    assert policy.codec_for("key", 1, 3).get_config()["bits"] == 4
    assert policy.sink_tokens == 4
    assert CodecPolicy.from_json(policy.to_json()) == policy
    with pytest.raises(KvtoolError, match="positive"):
        choose(m, -1.0)


@pytest.mark.slow
def test_a_budget_no_option_fits_is_refused_before_measuring(loaded, monkeypatch):
    import kvtool.calibrate as calibrate_module

    def measure(*args, **kwargs):
        raise AssertionError("measured (~75 s on the default model) before refusing")

    monkeypatch.setattr(calibrate_module, "measure", measure)
    menu = {"2b": "turbomix:bits=2", "4b": "turbo4"}
    for budget, message in ((0.5, "below the smallest choice"), (float("nan"), "positive")):
        with pytest.raises(KvtoolError, match=message):
            calibrate_module.calibrate(loaded, budget, menu=menu)


def test_calibrate_default_model_tiny_menu(loaded, tmp_path, monkeypatch, runner):
    """A real calibration (2 options, 40 tokens) gives a policy within budget that
    CompressedCache and kvtool.save accept; the CLI writes it and reuses the measurements."""
    import kvtool.calibrate as calibrate_module
    from kvtool.cache import KVCache
    from kvtool.cli.main import cli
    from kvtool.engines.hf import capture
    from kvtool.engines.hf_runtime import CompressedCache
    from kvtool.formats import load, save
    from kvtool.policy_files import load_policy

    monkeypatch.setattr(calibrate_module, "_cache_path",
                        lambda loaded, key: tmp_path / "cache" / f"{key[:16]}.json")
    menu = {"2b": "turbomix:bits=2", "4b": "turbo4"}
    cal = calibrate_module.calibrate(loaded, 3.0, tokens=40, scored=6, menu=menu)
    m = cal.measurements
    assert not m.cached and len(m.kl) == 30 and cal.mean_bits <= 3.0
    assert {r["key"] for r in cal.rows} | {r["value"] for r in cal.rows} == {"2b", "4b"}
    assert all(k > 0 for layer in m.kl for role in layer for k in role)  # lossy → KL > 0
    policy = cal.policy
    assert policy.layers and policy.num_layers == 30
    # CompressedCache and kvtool.save take it
    past = CompressedCache(policy, config=loaded.model.config)
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog.",
                           return_tensors="pt").input_ids
    loaded.model(input_ids=ids, past_key_values=past, use_cache=True)
    cache: KVCache = capture(loaded.model, loaded.tokenizer, "The quick brown fox jumps.")
    save(cache, tmp_path / "c.kvz", policy=policy)
    assert load(tmp_path / "c.kvz").num_layers == 30
    # the CLI: same measurements from the cache, a policy file within budget
    out = tmp_path / "policy.json"
    result = runner.invoke(cli, ["calibrate", "--bits", "3", "-o", str(out), "--tokens", "40",
                                 "--scored", "6", "--menu", "2b,4b", "--json"])
    assert result.exit_code == 0, result.output
    assert "--scored 6: a per-layer KL over fewer than 16 tokens is mostly noise" in \
        result.output  # was written without a word
    written = json.loads(out.read_text())
    assert written["calibration"]["mean_bits"] <= 3.0
    assert written["calibration"]["weights"] == loaded.info["weights"]
    assert load_policy(out).num_layers == 30
    bad = runner.invoke(cli, ["calibrate", "--bits", "0.5", "-o", str(out), "--tokens", "40",
                              "--scored", "6", "--menu", "2b,4b"])
    assert bad.exit_code != 0 and "below the smallest choice" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    covered = runner.invoke(cli, ["calibrate", "--bits", "3", "-o", str(tmp_path / "no.json"),
                                  "--tokens", "40", "--scored", "6", "--menu", "2b,4b",
                                  "--sink-tokens", "34"])  # sinks cover the whole prefix:
    assert covered.exit_code != 0 and "fewer --sink-tokens" in covered.output  # every KL was 0
    assert not (tmp_path / "no.json").exists()
    lossless = runner.invoke(cli, ["calibrate", "--bits", "16", "-o", str(tmp_path / "no.json")])
    assert lossless.exit_code == 2 and "0<x<16" in lossless.output  # refused before measuring
    unknown = runner.invoke(cli, ["calibrate", "--bits", "3", "-o", str(out), "--menu", "9b"])
    assert unknown.exit_code != 0 and "unknown option '9b'" in unknown.output
    # calibrate → capture with --policy → inspect → generate from the file, all from the CLI
    kvz = tmp_path / "calibrated.kvz"
    cap = runner.invoke(cli, ["capture", "--prompt", "The lighthouse keeper wrote down ships.",
                              "--policy", str(out), "-o", str(kvz)])
    assert cap.exit_code == 0, cap.output
    info = json.loads(runner.invoke(cli, ["inspect", str(kvz), "--json"]).output)
    assert info["policy"]["layers"] and info["codecs"]["turbomix"] > 0  # the per-layer policy
    gen = runner.invoke(cli, ["generate", "--cache", str(kvz), "--prompt", " Then", "--max-tokens",
                              "3", "--no-compare", "--json"])
    assert gen.exit_code == 0, gen.output
    both = runner.invoke(cli, ["capture", "--prompt", "x", "--policy", str(out), "--preset",
                               "quality", "-o", str(tmp_path / "both.kvz")])
    assert both.exit_code != 0 and "not both" in both.output
    # a policy calibrated for a model of another KV layout is refused once the model is known
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**written, "calibration": {**written["calibration"],
                                                            "fingerprint": "0" * 64}}))
    for args in (["capture", "--prompt", "x", "-o", str(tmp_path / "o.kvz")],
                 ["compress", str(kvz), "-o", str(tmp_path / "o.kvz")]):
        res = runner.invoke(cli, [*args, "--policy", str(other)])
        assert res.exit_code == 5 and "was calibrated for" in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
        assert not (tmp_path / "o.kvz").exists()


@pytest.mark.parametrize("damage", ["nan", "layers", "options", "negative"])
def test_a_damaged_cached_measurement_is_measured_again(loaded, tmp_path, monkeypatch, damage):
    """The measurement cache is a file anyone can edit: an entry of the wrong shape (another
    model's layer count, another menu) or with KLs that are not finite and >= 0 is measured
    again, not turned into a policy (or an IndexError)."""
    import kvtool.calibrate as calibrate_module

    monkeypatch.setattr(calibrate_module, "_cache_path",
                        lambda loaded, key: tmp_path / "cache" / f"{key[:16]}.json")
    runs = []

    def fake_kl(model, ids, scored, sinks, codecs, batch=8):
        runs.append(1)
        return [[[0.01 * (i + 1)] * len(codecs[r]) for r in ("key", "value")]
                for i in range(30)]

    monkeypatch.setattr(calibrate_module, "_measure_kl", fake_kl)
    menu = {"2b": "turbomix:bits=2", "4b": "turbo4"}
    first = calibrate_module.measure(loaded, tokens=40, scored=6, menu=menu)
    assert runs == [1] and not first.cached
    path = next((tmp_path / "cache").glob("*.json"))
    data = json.loads(path.read_text())
    if damage == "nan":
        data["kl"][3][0][1] = float("nan")
    elif damage == "layers":
        data["kl"] = data["kl"][:5]
    elif damage == "options":
        data["kl"][0][1] = [0.1]
    else:
        data["kl"][7][1][0] = -1.0
    path.write_text(json.dumps(data))
    again = calibrate_module.measure(loaded, tokens=40, scored=6, menu=menu)
    assert runs == [1, 1] and not again.cached and again.kl == first.kl
    assert calibrate_module.measure(loaded, tokens=40, scored=6, menu=menu).cached


def test_another_checkpoint_of_the_layout_is_measured_anew(loaded, tmp_path, monkeypatch):
    """A fine-tune has the base model's layout but its own KL: the measurement cache keys by
    the checkpoint (``model.weights``) too."""
    import dataclasses

    import kvtool.calibrate as calibrate_module

    monkeypatch.setattr(calibrate_module, "_cache_path",
                        lambda loaded, key: tmp_path / "cache" / f"{key[:16]}.json")
    runs = []

    def fake_kl(model, ids, scored, sinks, codecs, batch=8):
        runs.append(1)
        return [[[0.01] * len(codecs[r]) for r in ("key", "value")] for _ in range(30)]

    monkeypatch.setattr(calibrate_module, "_measure_kl", fake_kl)
    menu = {"4b": "turbo4"}
    assert loaded.info.get("weights")
    tuned = dataclasses.replace(loaded, info={**loaded.info, "weights": "0" * 64})
    assert not calibrate_module.measure(loaded, tokens=40, scored=6, menu=menu).cached
    assert calibrate_module.measure(loaded, tokens=40, scored=6, menu=menu).cached
    assert not calibrate_module.measure(tuned, tokens=40, scored=6, menu=menu).cached
    assert runs == [1, 1]
