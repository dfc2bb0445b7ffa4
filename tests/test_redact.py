"""rayspeed.redact: which names are secrets, URIs without their credentials, free text and nested configs masked."""

import json
import re
from pathlib import Path

import pytest

from rayspeed.redact import MASK, is_secret_key, redact_mapping, redact_text, redact_uri

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY",
                                  "apiKey", "db_passwd", "cluster.env.HF_TOKEN", "GCP_CREDENTIALS", "PROXY_AUTH",
                                  "x-api-key", "AccessToken"])
def test_secret_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["data.tokenizer", "max_tokens", "monkey", "RAY_AUTH_MODE", "AWS_ACCESS_KEY_ID",
                                  "AWS_WEB_IDENTITY_TOKEN_FILE", "NCCL_SOCKET_IFNAME", "tracking.uri", "keyboard",
                                  "model.experts_per_token"])
def test_names_that_are_not_secrets(name):
    assert not is_secret_key(name)


def test_uris_lose_their_credentials_only():
    assert redact_uri("http://alice:pw@mlflow:5000/api?x=1") == f"http://alice:{MASK}@mlflow:5000/api?x=1"
    assert redact_uri("https://ghp_abc123@host/repo.git") == f"https://{MASK}@host/repo.git"
    assert (redact_uri("https://h/p?a=1&token=t0k&X-Amz-Signature=s1g&b=2#frag")
            == f"https://h/p?a=1&token={MASK}&X-Amz-Signature={MASK}&b=2#frag")
    for plain in ("sqlite:////tmp/mlflow.db", "s3://bucket/runs", "http://mlflow:5000", "file:///a/b"):
        assert redact_uri(plain) == plain


def test_free_text():
    env = {"MY_SERVICE_PASSWORD": "correct-horse-battery", "PATH": "/usr/bin"}
    text = ("run at http://u:pw@h:5000 HF_TOKEN=hf_abc123 --set cluster.env='{HF_TOKEN: hf_abc123}' "
            '"API_KEY": "two words" other=1 the password correct-horse-battery leaked')
    out = redact_text(text, environ=env)
    assert "pw@" not in out and "hf_abc123" not in out and "two words" not in out
    assert "correct-horse-battery" not in out
    assert f"http://u:{MASK}@h:5000" in out and f"HF_TOKEN={MASK}" in out and f'"API_KEY": "{MASK}"' in out
    assert "other=1" in out
    assert redact_text("tokenizer: bytes, max_tokens=5", environ={}) == "tokenizer: bytes, max_tokens=5"


def test_nested_config():
    cfg = {"cluster": {"env": {"HF_TOKEN": "hf_abc", "NCCL_DEBUG": "WARN"}},
           "tracking": {"uri": "http://a:b@h:5000"}, "data": {"tokenizer": "bytes", "path": ["s3://b/x?sig=1"]}}
    out = redact_mapping(cfg)
    assert out == {"cluster": {"env": {"HF_TOKEN": MASK, "NCCL_DEBUG": "WARN"}},
                   "tracking": {"uri": f"http://a:{MASK}@h:5000"},
                   "data": {"tokenizer": "bytes", "path": [f"s3://b/x?sig={MASK}"]}}
    assert cfg["cluster"]["env"]["HF_TOKEN"] == "hf_abc"  # a copy: the original keeps its values


@pytest.mark.parametrize("name", ["PGPASSWORD", "DB_PASS", "REDIS_PASS", "GITHUB_PAT", "MYSQL_ROOT_PASSWORD",
                                  "githubtoken"])
def test_secret_names_the_env_profile_used_to_miss(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["pass_rate", "path", "patience", "password_min_len", "token_count"])
def test_look_alikes_are_not_secrets(name):
    assert not is_secret_key(name)


def test_paths_are_never_masked(tmp_path):
    # PWD's value is the launch directory: every path under it used to print as ***.
    launch = tmp_path / "rayspeed"
    launch.mkdir()
    env = {"PWD": str(launch), "OLDPWD": str(tmp_path), "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "sa.json")}
    text = f"MLflow run at sqlite:///{launch}/mlflow.db, model exported to {launch}/runs/x/model"
    assert redact_text(text, environ=env) == text
    assert redact_text(f"credentials: {tmp_path}/sa.json", environ={}) == f"credentials: {tmp_path}/sa.json"
    assert redact_text(f"PWD={launch}", environ={}) == f"PWD={launch}"
    assert redact_mapping({"env": {"GOOGLE_APPLICATION_CREDENTIALS": f"{tmp_path}/sa.json", "HF_TOKEN": "hf_x"}}) == {
        "env": {"GOOGLE_APPLICATION_CREDENTIALS": f"{tmp_path}/sa.json", "HF_TOKEN": MASK}}


def test_a_secret_that_starts_like_a_path_is_still_a_secret():
    secret = "/K7MDENG/bPxRfiCYEXAMPLEKEYwJalrXUtnFEMI"
    assert redact_mapping({"AWS_SECRET_ACCESS_KEY": secret}) == {"AWS_SECRET_ACCESS_KEY": MASK}
    assert secret not in redact_text(f"AWS_SECRET_ACCESS_KEY={secret} and again {secret}",
                                     environ={"AWS_SECRET_ACCESS_KEY": secret})
    assert redact_text("connection: Server=db;UID=sa;PWD=Secr3tPass9;", environ={}).count("Secr3tPass9") == 0


def test_http_credentials_lose_the_token():
    for line in ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abc.def",
                 '{"Authorization": "Basic dXNlcjpodW50ZXIyMjI="}',
                 "curl -H 'authorization: token ghp_0123456789abcdef' https://h"):
        out = redact_text(line, environ={})
        assert MASK in out
        assert not any(t in out for t in ("eyJhbGci", "dXNlcjpo", "ghp_0123")), out


def test_prose_keys_and_settings_stay_readable():
    for plain in ("cache key: 3f2a9c1b0d4e5f6a7b8c", "sort key=loss", "token=5", "password_min_len=12",
                  "tokens: 32551", "hash key=0123456789abcdef", "eos token: <|eot_id|>"):
        assert redact_text(plain, environ={}) == plain, plain
    assert redact_text("api_key=sk-live-0123456789", environ={}) == f"api_key={MASK}"
    assert redact_text("key=AKIAIOSFODNN7EXAMPLEKEY", environ={}) == f"key={MASK}"
    assert redact_text("DB_PASS=hunter2hunter2 REDIS_PASS='x y'", environ={}) == f"DB_PASS={MASK} REDIS_PASS='{MASK}'"


@pytest.mark.parametrize("line, secret", [
    ("OpenAI api key: sk-abcdefghijklmnop", "sk-abcdefghijklmnop"),
    ("Using auth token: ghp_abcdefghijklmnop", "ghp_abcdefghijklmnop"),
    ("AWS secret key=wJalrXUtnFEMIK7MDENG", "wJalrXUtnFEMIK7MDENG"),
    ("HF access token: 'hf_abcdefghijkl'", "hf_abcdefghijkl"),
    ("refresh token=eyJhbGciOiJIUzI1NiJ9", "eyJhbGciOiJIUzI1NiJ9"),
    ("host=db user=u password=hunter2", "hunter2"),
    ("--password=hunter2", "hunter2"),
    ("PGPASSWORD=12345678", "12345678"),
    ("X-API-Key: abc123", "abc123"),
])
def test_credentials_in_prose_are_masked(line, secret):
    assert secret not in redact_text(line, environ={}), redact_text(line, environ={})


def test_object_store_uris_lose_the_whole_key_pair():
    assert redact_uri("s3://AKIAKEY:SECRETVALUE@minio:9000/b") == f"s3://{MASK}@minio:9000/b"
    assert redact_uri("ftp://u:PW@host/x") == f"ftp://u:{MASK}@host/x"


def test_config_errors_are_masked():
    from rayspeed.config import parse
    from rayspeed.errors import ConfigError

    for overrides, secret in ((["storage.path=ftp://u:PW0rdPW0rd@host/x"], "PW0rdPW0rd"),
                              (["model.pretrained=https://u:PW0rdPW0rd@example.org/m"], "PW0rdPW0rd"),
                              (["cluster.env={HF_TOKEN: [hf_0123456789abcdef]}"], "hf_0123456789abcdef")):
        with pytest.raises(ConfigError) as e:
            parse({}, overrides)
        assert secret not in e.value.render() and secret not in str(e.value), e.value.render()


def test_generic_names_are_masked_by_value_only():
    # The planner's claims name each layout key in a field called `key`: a name, not a secret.
    claims = '[{"kind": "key", "key": "activation_checkpointing", "chosen": "none"}, {"key": "tp"}]'
    assert redact_text(claims, environ={}) == claims
    assert redact_mapping({"key": "micro_batch_size", "token": "<|eot_id|>"}) == {
        "key": "micro_batch_size", "token": "<|eot_id|>"}
    for credential in ("AKIAIOSFODNN7EXAMPLE", "hf_AbCdEf0123456789GhIjKlMnOpQrStUv", "wJalrXUtnFEMIK7MDENG2bPxRfiCY"):
        assert redact_mapping({"key": credential}) == {"key": MASK}
        assert redact_text(f'{{"token": "{credential}"}}', environ={}) == f'{{"token": "{MASK}"}}'
    assert redact_text("TOKEN=activation_checkpointing", environ={"TOKEN": "activation_checkpointing"}) == (
        "TOKEN=activation_checkpointing")
    for name in ("model.layers.0.self_attn.q_proj.weight", "Qwen3-30B-A3B-Instruct-2507", "checkpoint_step00000002"):
        assert redact_text(f"missing key: {name}", environ={}) == f"missing key: {name}"
        assert redact_mapping({"key": name}) == {"key": name}


def test_known_token_formats_are_masked_wherever_they_occur():
    hf, ghp = "hf_AbCdEf0123456789GhIjKlMnOpQrStUv", "ghp_Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa"
    out = redact_text(f"login with {hf}; clone with {ghp} now", environ={})
    assert out == f"login with {MASK}; clone with {MASK} now"
    for plain in ("sk-learn-classifier-model-v2", "hf_parity_check_of_the_tiny_model_2", "tests/_hf_parity.py"):
        assert redact_text(plain, environ={}) == plain


# What a tiny job is given: a token in its cluster.env, a password in a URI in its cluster.env and a secret-named
# variable in the launching shell. None may be written anywhere in clear.
HF_TOKEN = "hf_RdKtq8Vw2XyZ4bN6mP0sLcJ5hG7fA9eTu3"
PROXY_PASSWORD = "Pr0xyPassw0rdQ7"
SHELL_SECRET = "sHe11SecretValue9Kx2"


def _text_files(root: Path):
    for p in sorted(root.rglob("*")):
        if p.is_file():
            yield p, p.read_bytes()


def test_a_jobs_run_and_storage_hold_no_secret_and_claims_keep_their_keys(tmp_path):
    from mlflow.tracking import MlflowClient

    from _cluster import run_job
    from rayspeed.config.layout import LAYOUT_KEYS

    home = tmp_path / "home"
    env = {"HF_TOKEN": HF_TOKEN, "HTTPS_PROXY_FOR_MIRROR": f"http://ci:{PROXY_PASSWORD}@127.0.0.1:9/"}
    args = ["--config", TINY, "--launcher", "local"]
    for s in ("name=redacted", "train.max_steps=2", "cluster.num_workers=1", "train.eval_every_steps=2",
              "resilience.checkpoint_every_steps=2", f"cluster.env={json.dumps(env)}"):
        args += ["--set", s]
    r, summary = run_job(home, args, None, timeout=300, env_extra={"RAYSPEED_TEST_API_KEY": SHELL_SECRET})
    assert r.returncode == 0 and summary and summary["status"] == "finished", r.stdout[-2000:] + r.stderr[-3000:]
    secrets = (HF_TOKEN, PROXY_PASSWORD, SHELL_SECRET)
    masked_key = re.compile(r"""["']?\bkey["']?\s*[:=]\s*["']?\*\*\*""")

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    seen = {f"param {k}": v for k, v in run.data.params.items()}
    seen.update({f"tag {k}": v for k, v in run.data.tags.items()})
    artifacts = tmp_path / "artifacts"
    client.download_artifacts(run.info.run_id, "", str(artifacts))
    storage = Path(run.data.params["storage.path.resolved"])
    files = [*_text_files(artifacts), *_text_files(storage), *_text_files(home)]
    assert {"plan/plan.json", "config/resolved.yaml", "health/preflight.json"} <= {
        str(p.relative_to(artifacts)) for p, _ in _text_files(artifacts)}
    assert any(p.parent.name.startswith("checkpoint_") for p, _ in _text_files(storage))
    seen.update({f"file {p}": data.decode("utf-8", "replace") for p, data in files})
    seen.update({"stdout": r.stdout, "stderr": r.stderr})
    leaks = [f"{where}: {s[:8]}..." for where, text in seen.items() for s in secrets if s in text]
    assert not leaks, "secrets in clear:\n" + "\n".join(leaks)
    masked = [where for where, text in seen.items() if masked_key.search(text)]
    assert not masked, "a field named key masked:\n" + "\n".join(masked)

    # The secrets reached the run and were masked there (not dropped), and the claims name their real keys.
    assert run.data.params["cluster.env.HF_TOKEN"] == MASK
    assert f"ci:{MASK}@127.0.0.1" in run.data.params["cluster.env.HTTPS_PROXY_FOR_MIRROR"]
    plan = json.loads((artifacts / "plan" / "plan.json").read_text())
    assert {c["key"] for c in plan["plan"]["claims"] if c["kind"] == "key"} == set(LAYOUT_KEYS)
    assert '"key": "tp"' in run.data.params["plan.claims"]
