"""One config source: ``SuperOffloadConfig``'s fields make the Trainer flags, the Accelerate plugin fields and every
text form (dict, JSON, YAML, environment), and each front end gives the same config and the same one-line errors."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

from transformers import HfArgumentParser

from hf_superoffload.config import USER_OPTIONS, PlannerOverrides, SuperOffloadConfig
from hf_superoffload.integrations.accelerate import SuperOffloadPlugin
from hf_superoffload.integrations.arguments import SuperOffloadArguments

# a value other than the default for every user option, as command-line text and as the parsed value
SAMPLES: dict[str, tuple[str, Any]] = {
    "bucket_size_mb": ("8", 8.0), "gpu_resident_buckets": ("2", 2), "speculation": ("false", False),
    "rollback": ("inverse", "inverse"), "cast_side": ("gpu", "gpu"), "weight_placement": ("flow", "flow"),
    "cpu_threads": ("3", 3), "pin_memory": ("false", False), "worker_timeout_s": ("30", 30.0),
    "check_finite": ("false", False), "max_consecutive_skips": ("0", 0), "accumulate_on_host": ("true", True),
    "host_accumulation_dtype": ("landing", "landing"), "chunked_loss": ("false", False),
}
# a value out of every user option's domain
BAD: dict[str, Any] = {
    "bucket_size_mb": 0, "gpu_resident_buckets": -1, "speculation": "maybe", "rollback": "magic",
    "cast_side": "north", "weight_placement": "x", "cpu_threads": 0, "pin_memory": "maybe", "worker_timeout_s": -1,
    "check_finite": "maybe", "max_consecutive_skips": -1, "accumulate_on_host": "maybe",
    "host_accumulation_dtype": "fp8", "chunked_loss": "maybe",
}
FIX = {f.name: f.metadata["fix"] for f in dataclasses.fields(SuperOffloadConfig) if "fix" in f.metadata}


@pytest.fixture(autouse=True)
def _no_offload_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("HF_SUPEROFFLOAD_"):
            monkeypatch.delenv(k)


def _args(tmp_path: Path, **kw: Any) -> SuperOffloadArguments:
    return SuperOffloadArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def _parse(tmp_path: Path, *flags: str) -> SuperOffloadArguments:
    (args,) = HfArgumentParser(SuperOffloadArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", *flags])
    return args


def test_the_tables_cover_every_user_option() -> None:
    assert set(SAMPLES) == set(BAD) == set(USER_OPTIONS)
    assert "overrides" not in USER_OPTIONS and len(USER_OPTIONS) <= 14


@pytest.mark.parametrize("name", USER_OPTIONS)
def test_every_option_has_a_generated_flag_with_its_help_and_it_reaches_the_config(tmp_path: Path, name: str) -> None:
    parser = HfArgumentParser(SuperOffloadArguments)
    action = next(a for a in parser._actions if f"--superoffload_{name}" in a.option_strings)
    meta = next(f.metadata for f in dataclasses.fields(SuperOffloadConfig) if f.name == name)
    assert meta["help"].replace("%", "%%") in action.help  # the config's own help line, not a copy
    text, value = SAMPLES[name]
    got = getattr(_parse(tmp_path, f"--superoffload_{name}", text).to_superoffload_config(), name)
    assert got == value and type(got) is type(value)


def test_planner_overrides_have_no_visible_flag_and_the_old_names_say_the_new_spelling(tmp_path: Path) -> None:
    parser = HfArgumentParser(SuperOffloadArguments)
    shown = parser.format_help()
    for f in dataclasses.fields(PlannerOverrides):
        assert f"--superoffload_{f.name}" not in shown
    with pytest.raises(ValueError, match=r"superoffload_d2h_gate was removed.*superoffload_config=\{\"overrides\": "
                                         r"\{\"d2h_gate\": 'false'\}\}") as e:
        _parse(tmp_path, "--superoffload_d2h_gate", "false")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="superoffload_max_redo_rate was removed"):
        _args(tmp_path, superoffload_max_redo_rate=1.0)
    assert "superoffload_d2h_gate" not in _args(tmp_path).to_dict()  # not saved with the hparams either


def _forms(tmp_path: Path, options: dict[str, Any]) -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    (tmp_path / "o.json").write_text(json.dumps(options))
    (tmp_path / "o.yaml").write_text(yaml.safe_dump(options))
    (tmp_path / "nested.yml").write_text(yaml.safe_dump({"superoffload": options}))
    return {"dict": options, "json": json.dumps(options), "json_file": str(tmp_path / "o.json"),
            "yaml_file": str(tmp_path / "o.yaml"), "nested_yaml": str(tmp_path / "nested.yml")}


def test_dict_json_and_yaml_forms_give_one_config_for_the_arguments_and_the_plugin(tmp_path: Path) -> None:
    options: dict[str, Any] = {name: value for name, (_, value) in SAMPLES.items()}
    options["overrides"] = {"d2h_gate": False, "max_redo_rate": 1.0, "defer_master": 0.25}
    want = SuperOffloadConfig(**{k: v for k, v in options.items() if k != "overrides"},
                              overrides=PlannerOverrides(d2h_gate=False, max_redo_rate=1.0, defer_master=0.25))
    for form, spec in _forms(tmp_path, options).items():
        assert _args(tmp_path, superoffload_config=spec).to_superoffload_config() == want, form
        assert SuperOffloadPlugin(config_file=spec).to_config() == want, form
    # text values (environment variables, YAML strings) are parsed by the option's type: the same config
    as_text = {name: text for name, (text, _) in SAMPLES.items()} | {"overrides": {
        "d2h_gate": "off", "max_redo_rate": "1", "defer_master": "0.25"}}
    assert SuperOffloadConfig.from_dict(as_text) == want
    assert SuperOffloadPlugin(config_file=as_text).to_config() == want
    flags = [x for name, (text, _) in SAMPLES.items() for x in (f"--superoffload_{name}", text)]
    assert _parse(tmp_path, *flags).to_superoffload_config() == want.replace(overrides=PlannerOverrides())


def test_a_flag_not_at_its_default_overrides_the_same_key_of_superoffload_config(tmp_path: Path) -> None:
    spec = json.dumps({"bucket_size_mb": 8, "speculation": False})
    cfg = _parse(tmp_path, "--superoffload_config", spec, "--superoffload_bucket_size_mb", "4").to_superoffload_config()
    assert (cfg.bucket_size_mb, cfg.speculation) == (4, False)


@pytest.mark.parametrize("name", USER_OPTIONS)
def test_a_bad_value_is_one_line_naming_the_option_and_the_fix(tmp_path: Path, name: str) -> None:
    bad = BAD[name]
    cases = [
        (lambda: SuperOffloadConfig(**{name: bad}), f"SuperOffloadConfig.{name}="),
        (lambda: SuperOffloadConfig.from_dict({name: str(bad)}), f"SuperOffloadConfig.{name}="),
        (lambda: _args(tmp_path, **{f"superoffload_{name}": bad}), f"SuperOffloadArguments.superoffload_{name}="),
        (lambda: _args(tmp_path, superoffload_config={name: bad}),
         f"SuperOffloadArguments.superoffload_config['{name}']="),
        (lambda: SuperOffloadPlugin(**{name: bad}), f"(set by SuperOffloadPlugin.{name})"),
    ]
    for build, where in cases:
        with pytest.raises(ValueError) as e:
            build()
        msg = str(e.value)
        assert "\n" not in msg and where in msg and FIX[name] in msg, msg


def test_unknown_keys_and_moved_keys_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown SuperOffload setting\(s\) \['bucket_size'\]"):
        _args(tmp_path, superoffload_config={"bucket_size": 8})
    with pytest.raises(ValueError, match=r"'upload_thread' is a planner override.*\{\"overrides\": "):
        SuperOffloadPlugin(config_file={"upload_thread": False})
    with pytest.raises(ValueError, match="neither a mapping, a JSON object nor an existing"):
        _args(tmp_path, superoffload_config="no_such_file.yaml")


def test_planner_overrides_from_the_environment_name_the_new_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_SUPEROFFLOAD_D2H_LEAD_BUCKETS", "4")
    with pytest.raises(ValueError, match=r"HF_SUPEROFFLOAD_D2H_LEAD_BUCKETS was removed.*'overrides:'"):
        SuperOffloadPlugin()


def test_config_round_trips_and_no_session_numbers_in_its_docs() -> None:
    cfg = SuperOffloadConfig(bucket_size_mb=4).with_overrides(d2h_gate=False)
    assert SuperOffloadConfig(**cfg.to_dict()) == cfg == SuperOffloadConfig.from_dict(cfg.to_dict())
    source = (Path(__file__).resolve().parents[2] / "hf_superoffload" / "config.py").read_text()
    assert "session" not in source.lower()
