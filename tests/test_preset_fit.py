"""Presets fitted per model (kvtool.preset_fit, ``kvtool calibrate --preset``): the fit measures
the menu within the budget, is recorded per model fingerprint, and every command that takes
``--preset`` uses it for that model and only that model; a fit file naming anything but a menu
policy is ignored."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvtool import preset_fit  # noqa: E402
from kvtool.engines.vllm.common import policy_from_extra  # noqa: E402
from kvtool.formats import open_kvz  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402
from kvtool.preset_fit import (  # noqa: E402
    BUDGETS,
    MENUS,
    Fit,
    expected_bits,
    fit_preset,
    fits_path,
    fitted_label,
    save_fit,
)
from kvtool.presets import PRESETS, fitted_weights, preset_policy  # noqa: E402

PROMPT = "The lighthouse keeper wrote down every ship that passed the rocks that night."


@pytest.fixture
def fits(tmp_path, monkeypatch):
    """An empty folder of fits for this test."""
    monkeypatch.setenv("KVTOOL_PRESET_FITS_DIR", str(tmp_path / "fits"))
    return tmp_path / "fits"


def _fit(name: str, label: str, fingerprint: str) -> Fit:
    return Fit(name, CodecPolicy.from_label(label).describe(), 3.2, 0.001, 0.1, "m",
               fingerprint, 64, ["t"], [1], 1.0)


def test_expected_bits_counts_the_exact_sinks():
    quality = CodecPolicy.from_label(PRESETS["quality"][0])
    coded = (quality.key.bits_per_element(64) + quality.value.bits_per_element(64)) / 2
    assert expected_bits(quality, 64, 2048) == pytest.approx((coded * 2044 + 64) / 2048)
    assert expected_bits(quality, 64, 4) == 16


def test_every_menu_policy_fits_its_budget_at_gemmas_head_dim():
    """The alternatives were chosen on Gemma 3 270M (head_dim 256): each must be measurable
    there, or the fit could never choose it (a menu edit that overspends fails here)."""
    for name, labels in MENUS.items():
        for label in labels:
            assert expected_bits(CodecPolicy.from_label(label), 256, 2048) <= BUDGETS[name], label


def test_fit_measures_the_menu_within_the_budget(loaded, fits):
    """At head_dim 64 quality's outlier alternatives spend 4.02-4.15 bits: over the budget, not
    measured; the fixed preset is the only one measured, so it is chosen."""
    fit = fit_preset(loaded, "quality", texts={"story_text.md": None}, tokens=96, seeds=(1,))
    skipped = [r for r in fit.candidates if "skipped" in r]
    assert fit.label == CodecPolicy.from_label(PRESETS["quality"][0]).describe()
    assert len(skipped) == len(MENUS["quality"]) - 1 and all("kl" not in r for r in skipped)
    assert 0 < fit.kl < 0.05 and fit.bits <= 4.0 and fit.tokens == 96
    assert fit.fingerprint == loaded.fingerprints["model"]


def test_an_alternative_is_chosen_only_when_it_wins_every_paired_run():
    """A fit over one text and one seed chose an alternative on a KL 2% lower, in the noise."""
    from kvtool.preset_fit import _wins_every_run

    def runs(*kls):
        keys = [("a", 1), ("a", 2), ("b", 1), ("b", 2)][:len(kls)]
        return [{"text": t, "seed": s, "kl": kl} for (t, s), kl in zip(keys, kls, strict=True)]

    assert _wins_every_run(runs(1, 2, 3, 4), runs(2, 3, 4, 5))
    assert not _wins_every_run(runs(1, 2, 3, 9), runs(2, 3, 4, 5))  # a lower mean, one loss
    assert not _wins_every_run(runs(1), runs(2))  # one run: noise cannot be told apart
    assert not _wins_every_run(runs(1, 2), [{"text": "c", "seed": 1, "kl": 5}] * 2)  # unpaired


def test_a_fit_changes_the_preset_for_its_model_only(fits):
    alternative = MENUS["balanced"][1]
    save_fit(_fit("balanced", alternative, "fp-a"))
    assert fitted_label("balanced", "fp-a") == CodecPolicy.from_label(alternative).describe()
    assert preset_policy("balanced", "fp-a") == CodecPolicy.from_label(alternative)
    assert preset_policy("balanced", "fp-b") == CodecPolicy.from_label(PRESETS["balanced"][0])
    assert preset_policy("balanced") == CodecPolicy.from_label(PRESETS["balanced"][0])
    assert preset_policy("quality", "fp-a") == CodecPolicy.from_label(PRESETS["quality"][0])
    # the vLLM store's policy from connector options follows the same fit
    assert policy_from_extra({"preset": "balanced"}, "fp-a").key == \
        CodecPolicy.from_label(alternative).key
    save_fit(_fit("small", MENUS["small"][1], "fp-a"))  # a second preset, the first kept
    assert fitted_label("balanced", "fp-a") and fitted_label("small", "fp-a")


def test_a_fit_made_before_select_scalar_means_todays_menu_policy(fits, caplog):
    """Fits written before the trellis menu policies picked their rotations by the scalar
    codebook name them with ``select=exact``: they keep working, as today's policy (the same
    kind of file, measured alike), without a warning."""
    for name in ("balanced", "small"):
        today = MENUS[name][0 if name == "small" else 1]
        assert "select=scalar" in today
        save_fit(_fit(name, today.replace(",select=scalar", ""), "fp-old"))
        with caplog.at_level("WARNING", logger="kvtool"):
            assert fitted_label(name, "fp-old") == CodecPolicy.from_label(today).describe()
    assert "ignoring" not in caplog.text


@pytest.mark.parametrize("damage", ["not json", "label", "fingerprint", "version"])
def test_a_crafted_or_damaged_fit_is_ignored(fits, damage, caplog):
    save_fit(_fit("balanced", MENUS["balanced"][1], "fp-a"))
    path = fits_path("fp-a")
    data = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{")
    else:
        if damage == "label":  # a policy that is not on the menu
            data["presets"]["balanced"]["label"] = "turbo2"
        elif damage == "fingerprint":  # copied from another model's file
            data["presets"]["balanced"]["fingerprint"] = "fp-b"
        else:
            data["version"] = 99
        path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="kvtool"):
        assert fitted_label("balanced", "fp-a") is None
        assert preset_policy("balanced", "fp-a") == CodecPolicy.from_label(PRESETS["balanced"][0])
        assert fitted_weights("balanced", "fp-a") is None
    # said once, though a command reads the file for its policy and again for its weights
    assert caplog.text.count("ignoring the preset fits") == 1, caplog.text


def test_the_shipped_fits_are_valid_menu_choices():
    """Each fit kvtool ships names its model by file and content, and only menu policies within
    their preset's budget at that model's head_dim (256: Gemma 3 270M)."""
    shipped = sorted(preset_fit.shipped_path("x").parent.glob("preset-fits-*.json"))
    assert shipped
    for path in shipped:
        data = json.loads(path.read_text())
        assert path.name == f"preset-fits-{data['fingerprint'][:32]}.json"
        for name, entry in data["presets"].items():
            policy = CodecPolicy.from_label(entry["label"])
            assert entry["label"] in {CodecPolicy.from_label(x).describe() for x in MENUS[name]}
            assert expected_bits(policy, 256, 2048) <= BUDGETS[name]
            assert fitted_label(name, data["fingerprint"]) == entry["label"]


def test_a_users_fit_comes_before_the_shipped_one(fits, tmp_path, monkeypatch):
    shipped = {"version": 1, "fingerprint": "fp-s", "model": "m", "presets": {
        name: _fit(name, MENUS[name][1], "fp-s").to_json() for name in ("balanced", "small")}}
    (tmp_path / "shipped.json").write_text(json.dumps(shipped))
    monkeypatch.setattr(preset_fit, "shipped_path", lambda fp: tmp_path / "shipped.json")
    assert fitted_label("balanced", "fp-s") == CodecPolicy.from_label(MENUS["balanced"][1]
                                                                      ).describe()
    save_fit(_fit("balanced", MENUS["balanced"][0], "fp-s"))  # the user's own: the fixed one
    assert fitted_label("balanced", "fp-s") == CodecPolicy.from_label(MENUS["balanced"][0]
                                                                      ).describe()
    # a preset the user did not fit still comes from the shipped file
    assert fitted_label("small", "fp-s") == CodecPolicy.from_label(MENUS["small"][1]).describe()
    assert fitted_label("quality", "fp-s") is None


def test_calibrate_preset_then_capture_and_compress_use_the_fit(loaded, fits, tmp_path, runner):
    """From the CLI: calibrate --preset records a fit for the default model; capture and
    compress with --preset then write its policy into the file, and say so."""
    from kvtool.cli.main import cli

    few = runner.invoke(cli, ["calibrate", "--preset", "balanced", "--tokens", "64",
                              "--seeds", "1", "--text", str(_text(tmp_path))])
    assert few.exit_code == 1 and "give --tokens 96 or more" in few.output, few.output
    early = runner.invoke(cli, ["calibrate", "--preset", "balanced", "--tokens", "64",
                                "--model", str(tmp_path / "no-such-model")])
    assert early.exit_code == 1 and "give --tokens 96" in early.output, early.output  # no load
    cal = runner.invoke(cli, ["calibrate", "--preset", "balanced", "--tokens", "96",
                              "--seeds", "1", "--text", str(_text(tmp_path)), "--json"])
    assert cal.exit_code == 0, cal.output
    fit = json.loads(cal.stdout)["fits"][0]
    assert fit["preset"] == "balanced" and fits_path(fit["fingerprint"]).is_file()
    assert {r["label"] for r in fit["candidates"]} == \
        {CodecPolicy.from_label(x).describe() for x in MENUS["balanced"]}
    # make the fit the alternative (the measured choice on 96 tokens could be either)
    save_fit(_fit("balanced", MENUS["balanced"][1], fit["fingerprint"]))
    want = CodecPolicy.from_label(MENUS["balanced"][1])
    out = tmp_path / "c.kvz"
    cap = runner.invoke(cli, ["capture", "--prompt", PROMPT, "--preset", "balanced", "-o",
                              str(out)])
    assert cap.exit_code == 0, cap.output
    assert "--preset balanced fitted to" in cap.output
    with open_kvz(out) as f:
        assert f.header["policy"]["key"] == want.key.get_config()
    raw, again = tmp_path / "raw.kvz", tmp_path / "again.kvz"
    assert runner.invoke(cli, ["capture", "--prompt", PROMPT, "-o", str(raw)]).exit_code == 0
    comp = runner.invoke(cli, ["compress", str(raw), "--preset", "balanced", "-o", str(again)])
    assert comp.exit_code == 0, comp.output
    with open_kvz(again) as f:
        assert f.header["policy"]["value"] == want.value.get_config()


def test_a_fit_to_other_weights_of_the_layout_is_warned_of(loaded, fits, tmp_path, runner):
    """Fits and calibrated policy files are keyed by KV layout: one measured on a fine-tune
    (or its base) was applied without a word."""
    import dataclasses

    from kvtool.cli.main import cli
    from kvtool.policy_files import save_policy

    fingerprint, weights = loaded.fingerprints["model"], loaded.info["weights"]
    fit = dataclasses.replace(_fit("balanced", MENUS["balanced"][1], fingerprint), weights="0" * 64)
    policy_file = tmp_path / "p.json"

    def fitted_on(measured: str) -> None:
        save_fit(dataclasses.replace(fit, weights=measured))
        save_policy(CodecPolicy.from_label("turbo3"), policy_file, {"calibration": {
            "model": "m", "fingerprint": fingerprint, "weights": measured}})

    warned = "fitted to m, which has this model's KV layout but other weights"
    for option, value in (("--preset", "balanced"), ("--policy", str(policy_file))):
        fitted_on("0" * 64)
        args = ["capture", "--prompt", PROMPT, option, value, "-o", str(tmp_path / "c.kvz")]
        out = runner.invoke(cli, args)
        assert out.exit_code == 0 and warned in out.output, out.output
        fitted_on(weights)  # its own weights: no warning
        out = runner.invoke(cli, args)
        assert out.exit_code == 0 and warned not in out.output, out.output


def test_calibrate_takes_bits_or_preset(runner):
    from kvtool.cli.main import cli

    for args, both in (([], False), (["--bits", "3", "--preset", "quality", "-o", "p.json"], True)):
        result = runner.invoke(cli, ["calibrate", *args])
        assert result.exit_code == 2 and "--bits" in result.output
        assert ("not both" in result.output) == both, result.output
    result = runner.invoke(cli, ["calibrate", "--preset", "tiny"])
    assert result.exit_code == 2 and "unknown tiny" in result.output
    result = runner.invoke(cli, ["calibrate", "--bits", "3"])
    assert result.exit_code == 2 and "-o/--output" in result.output


def _text(tmp_path):
    from kvtool.evaluate import data_text

    path = tmp_path / "text.txt"
    path.write_text(data_text("story_text.md"), encoding="utf-8")
    return path


def test_a_text_shorter_than_tokens_is_measured_in_chunks_of_its_length(loaded, fits):
    """``--text`` of 120 tokens with the default ``--tokens 1024``: measured (its chunks fit
    its length), not refused with advice about a --chunk option calibrate does not have; a
    text too short to measure anything is refused, naming its length."""
    from kvtool.errors import KvtoolError
    from kvtool.evaluate import data_text

    ids = loaded.tokenizer(data_text("story_text.md")).input_ids
    text = loaded.tokenizer.decode(ids[1:121])
    fit = fit_preset(loaded, "balanced", texts={"short": text}, seeds=(1,))
    assert 96 <= fit.tokens <= 130 and 0 < fit.kl
    # one run cannot tell the menu's policies apart: the fixed preset stays, whatever won
    fixed, other = fit.candidates[0], fit.candidates[1]
    assert fit.label == fixed["label"] == CodecPolicy.from_label(PRESETS["balanced"][0]).describe()
    assert ("not_chosen" in other) == (other["kl"] < fixed["kl"])
    with pytest.raises(KvtoolError, match="has 4[0-9] tokens"):
        fit_preset(loaded, "balanced", texts={"tiny": loaded.tokenizer.decode(ids[1:46])},
                   seeds=(1,))
