"""rayspeed.redact: which names are secrets, URIs without their credentials, free text and nested configs masked."""

import pytest

from rayspeed.redact import MASK, is_secret_key, redact_mapping, redact_text, redact_uri


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
