"""rayspeed.redact: which names are secrets, URIs without their credentials, free text and nested configs masked."""

import pytest

from rayspeed.redact import MASK, is_secret_key, redact_mapping, redact_text, redact_uri


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY",
                                  "apiKey", "db_passwd", "cluster.env.HF_TOKEN", "GCP_CREDENTIALS", "PROXY_AUTH",
                                  "x-api-key", "AccessToken"])
def test_secret_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["data.tokenizer", "max_tokens", "monkey", "RAY_AUTH_MODE", "AWS_ACCESS_KEY_ID",
                                  "AWS_WEB_IDENTITY_TOKEN_FILE", "NCCL_SOCKET_IFNAME", "tracking.uri", "keyboard"])
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
