"""Secrets out of everything rayspeed writes: the log, MLflow params, tags and text artifacts (config/resolved.yaml,
health/preflight.json), the healthcheck and doctor output, the crontab line, the retraining history. One function
family, used by every writer; the values themselves still reach the processes that need them (the workers'
environment, the MLflow client).

    is_secret_key("HF_TOKEN")                  True: a name with a secret word (TOKEN, KEY, SECRET, PASSWORD,
                                               PASSWD, CREDENTIAL(S), AUTH, ...), matched as a whole word
    redact_uri("http://u:pw@h:5000/?token=t")  "http://u:***@h:5000/?token=***"
    redact_text(text)                          every URI in the text, NAME=value / NAME: value pairs whose NAME
                                               looks secret, and the values of secret-named environment variables
    redact_mapping(obj)                        nested dicts/lists: values under secret-looking keys masked,
                                               every string through redact_text

Names are split into words (on `_ . - /`, spaces and camelCase); a name is secret when one of its words is a secret
word or ends with one of the unambiguous ones (`PGPASSWORD`, `githubtoken`), or when its last word is `pass` or
`pat` (`DB_PASS`, `GITHUB_PAT`). So `data.tokenizer`, `max_tokens` or `monkey` are not secrets while
`cluster.env.HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`, `apiKey` and `MLFLOW_TRACKING_PASSWORD` are; a word after `per`
is a rate (`model.experts_per_token` is a setting). Names whose last word
says the value is a mode, a type, a file location or a size (`RAY_AUTH_MODE`, `AWS_WEB_IDENTITY_TOKEN_FILE`,
`password_min_len`) are not: their values are settings.

Masking never hides a path or a setting. A path is a value shaped like one (`/`, `~/`, `./`, `../`) that exists on
this machine or whose parent folder does (other than `/`): `$PWD`'s value is one, a base64 secret that happens to
start with `/` is not.

A generic name is never a reason to mask: `key`, `token`, `auth` or `pat` alone (a JSON field `"key": "tp"` in the
planner's claims, a dict's `key`, `sort key=loss` in prose) names a thing, and what it holds is masked only when
the value itself looks like a credential (looks_like_credential: a known token format such as `hf_...`, `ghp_...`,
`sk-...`, `AKIA...`, a JWT, or a long random-looking string of letters and digits). Names that say secret
(`HF_TOKEN`, `api_key`, `AWS_SECRET_ACCESS_KEY`, `db_password`) mask whatever non-path value they hold.
The rules for free text:
- a `NAME=value` / `NAME: value` / `"NAME": "value"` pair under a secret NAME is masked, unless the value is a
  path; under a generic NAME only a credential-looking value is, and not after a word that makes it a thing
  (`cache key: 3f2a...`, `hash key`, ...);
- an HTTP credential (`Authorization: Bearer <token>`, `Basic <base64>`) loses the credential;
- self-identifying tokens (Hugging Face, GitHub, GitLab, Slack, OpenAI/Anthropic, Google keys, JWTs: KNOWN_TOKEN)
  are masked wherever they occur, whatever names them or if nothing does;
- the values of secret-named environment variables (6 characters or more, not paths) are masked wherever they occur.
In mappings (configs, params, environments) every non-empty value under a secret key is masked, except paths;
URIs anywhere lose the password of their userinfo (object stores: the whole userinfo, an access key pair) and the
values of secret query parameters. An AWS access key id (`AKIA...`) is masked under a generic name or in a URI's
userinfo, not on its own: it identifies a key without granting anything, and AWS_ACCESS_KEY_ID stays readable.
Pure Python (no imports beyond the standard library): every layer may use it.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit, urlunsplit

MASK = "***"

SECRET_WORDS = frozenset({
    "token", "key", "secret", "secrets", "password", "passwords", "passwd", "pwd", "credential", "credentials",
    "auth", "authorization", "apikey", "accesskey", "secretkey", "passphrase", "privatekey",
})
# Secret words that end longer words too: PGPASSWORD, MYSQL_ROOTPASSWORD, GITHUBTOKEN.
SECRET_SUFFIXES = ("password", "passwd", "token", "secret", "apikey")
# Secret only as the last word of a name: DB_PASS, REDIS_PASS, GITHUB_PAT (not pass_rate).
SECRET_LAST_WORDS = frozenset({"pass", "pat"})
# Secret words that are often something else: a lone one needs a credential-looking value.
WEAK_WORDS = frozenset({"key", "token", "auth", "pat"})
# Words before a lone weak word that make it a thing, not a credential: "cache key: 3f2a", "sort key=loss".
PROSE_BEFORE = frozenset({"cache", "sort", "hash", "partition", "primary", "foreign", "lookup", "dict", "map",
                          "index", "group", "join", "shard", "dedup", "routing", "row", "column", "sorting", "grouping",
                          "composite", "unique", "next", "previous", "special", "bos", "eos", "pad", "unk", "end",
                          "start", "stop", "first", "last", "input", "output", "vocab"})
# The last word of a name that holds a setting, a location or a size, not the secret itself.
NOT_SECRET_LAST_WORDS = frozenset({"mode", "type", "file", "path", "dir", "method", "enabled", "id", "len", "length",
                                   "count", "size"})
# URI schemes whose userinfo is an access key pair: both halves are masked.
KEY_PAIR_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs", "abfs", "abfss", "az", "wasb", "wasbs", "oss"})
MIN_CREDENTIAL_LEN = 8
# Query parameters that carry credentials besides secret-named ones (signed URLs).
SECRET_QUERY_PARAMS = frozenset({"sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                                 "x-goog-signature", "x-goog-credential", "access_token"})
# Environment values shorter than this are not hunted for in free text (too likely to occur by chance).
MIN_ENV_SECRET_LEN = 6
# Prefixes of credential formats (each vendor's documented token shape): under a generic name such a value is one.
CREDENTIAL_PREFIXES = ("hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "xoxa-", "xoxb-",
                       "xoxp-", "xoxr-", "xoxs-", "sk-", "sk_live_", "rk_live_", "AKIA", "ASIA", "AIza", "ya29.", "eyJ")
# A random-looking value under a generic name: this long at least, letters and digits, this many bits per character
# (Shannon), and one run of MIN_RANDOM_RUN characters between separators mixing letters and digits. Identifiers such
# as `activation_checkpointing` have no digit, `hunter2hunter2` repeats itself, and a state-dict key
# (`model.layers.0.self_attn.q_proj.weight`) or a model name (`Qwen3-30B-A3B-Instruct-2507`) mixes them only across
# separators.
MIN_RANDOM_LEN = 16
MIN_RANDOM_BITS = 3.5
MIN_RANDOM_RUN = 8
# Tokens that say what they are: masked by value wherever they occur. Each needs digits and both cases after its
# prefix (_random_enough), so that names such as `sk-learn-classifier-model-v2` or `hf_parity_check` stay.
KNOWN_TOKEN = re.compile(
    r"(?<![A-Za-z0-9_\-])(?P<prefix>hf_|gh[pousr]_|github_pat_|glpat-|xox[aboprs]-|sk-(?:proj-|ant-|svcacct-)?"
    r"|AIza|ya29\.)(?P<body>[A-Za-z0-9_\-]{20,})(?![A-Za-z0-9_\-])"
    r"|(?<![A-Za-z0-9_\-])(?P<jwt>eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})")

_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_PAIR = re.compile(
    r"(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P<nq>[\"']?)(?P<sep>[ \t]*(?:=|:(?!//))[ \t]*)"
    r"(?:\"(?P<dq>[^\"\n]*)\"|'(?P<sq>[^'\n]*)'|(?P<bare>[^\s,;{}\[\]\"'&]+))")


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_SPLIT.split(str(name)) if w]


def is_generic_name(name: Any) -> bool:
    """`key`, `token`, `auth` or `pat` alone: a name that says nothing about its value being a secret (module doc)."""
    words = _words(str(name))
    return len(words) == 1 and words[0] in WEAK_WORDS


def is_secret_key(name: Any) -> bool:
    """Whether a key, variable or parameter name looks like it holds a secret (see the module doc)."""
    words = _words(str(name))
    if not words or words[-1] in NOT_SECRET_LAST_WORDS:
        return False
    if words[-1] in SECRET_LAST_WORDS:
        return True
    # "per <word>" is a rate, a setting: model.experts_per_token, requests_per_key.
    return any((w in SECRET_WORDS or w.endswith(SECRET_SUFFIXES)) and not (i and words[i - 1] == "per")
               for i, w in enumerate(words))


def is_path(value: str) -> bool:
    """A filesystem location (never masked: masking must not hide where things are): path-shaped, and it or its
    parent folder (other than the root) exists here. A secret that merely starts with "/" is not one."""
    if not (value.startswith(("/", "~/", "./", "../")) or re.match(r"^[A-Za-z]:[\\/]", value)):
        return False
    p = os.path.abspath(os.path.expanduser(value.rstrip("/") or "/"))
    parent = os.path.dirname(p)
    try:
        return os.path.exists(p) or (parent not in ("/", "") and os.path.isdir(parent))
    except (OSError, ValueError):
        return False


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


_TOKEN_CHARS = re.compile(r"[A-Za-z0-9+/=_\-.~]+")


def _random_enough(text: str, both_cases: bool = False) -> bool:
    if not (any(c.isdigit() for c in text) and any(c.isalpha() for c in text)):
        return False
    if both_cases and not (any(c.islower() for c in text) and any(c.isupper() for c in text)):
        return False
    n = len(text)
    bits = -sum(k / n * math.log2(k / n) for k in Counter(text).values())
    return bits >= MIN_RANDOM_BITS


def looks_like_credential(value: str) -> bool:
    """Whether a value is shaped like a credential by itself (what a generic name such as `key` needs to be masked):
    a known token format, or a long random-looking string (module doc). Never a path, a number or prose."""
    if len(value) < MIN_CREDENTIAL_LEN or any(c.isspace() for c in value) or value == MASK or is_path(value):
        return False
    if _NUMBER.fullmatch(value):
        return False
    if value.startswith(CREDENTIAL_PREFIXES) or KNOWN_TOKEN.fullmatch(value):
        return True
    if len(value) < MIN_RANDOM_LEN or _TOKEN_CHARS.fullmatch(value) is None or not _random_enough(value):
        return False
    runs = re.split(r"[+/=_\-.~]+", value)
    return any(len(r) >= MIN_RANDOM_RUN and any(c.isdigit() for c in r) and any(c.isalpha() for c in r) for r in runs)


def _known_tokens(text: str) -> str:
    def mask(m: re.Match) -> str:
        if m.group("jwt") or _random_enough(m.group("body"), both_cases=True):
            return MASK
        return m.group(0)

    return KNOWN_TOKEN.sub(mask, text)


def _secret_query_param(name: str) -> bool:
    return is_secret_key(name) or name.lower() in SECRET_QUERY_PARAMS


def redact_uri(uri: str) -> str:
    """The URI without credentials: the password of its userinfo (or the whole userinfo when it is a lone token)
    and the values of secret-looking query parameters become ***."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if userinfo and userinfo != MASK:
            user, sep, _ = userinfo.partition(":")
            if parts.scheme.lower() in KEY_PAIR_SCHEMES:
                netloc = f"{MASK}@{host}"
            else:
                netloc = f"{user}:{MASK}@{host}" if sep else f"{MASK}@{host}"
    query = parts.query
    if query:
        def mask(m: re.Match) -> str:
            return f"{m.group(1)}{m.group(2)}={MASK}" if _secret_query_param(m.group(2)) and m.group(3) else m.group(0)

        query = re.sub(r"(^|[&;])([^=&;]+)=([^&;]*)", mask, query)
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def env_secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Values of this process's secret-named environment variables (longest first), to mask wherever they occur."""
    env = os.environ if environ is None else environ
    vals = {v for k, v in env.items()
            if v and len(v) >= MIN_ENV_SECRET_LEN and is_secret_key(k) and v != MASK and not is_path(v)
            and (not is_generic_name(k) or looks_like_credential(v))}
    return sorted(vals, key=len, reverse=True)


def redact_text(text: Any, environ: Optional[Mapping[str, str]] = None) -> Any:
    """Free text with every secret masked: URIs' credentials, NAME=value / NAME: value / "NAME": "value" pairs
    whose NAME looks secret, known token formats, and the values of secret-named environment variables.
    Non-strings pass through."""
    if not isinstance(text, str) or not text:
        return text
    out = _known_tokens(_pairs(_http_credentials(_URI.sub(lambda m: redact_uri(m.group(0)), text))))
    for v in env_secret_values(environ):
        if v in out:
            out = out.replace(v, MASK)
    return out


# "Authorization: Bearer x", "Proxy-Authorization: Basic x", and a bare "Bearer x" anywhere.
_AUTH_HEADER = re.compile(r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z-]+\s+)?)([^\s\"',;]+)")
_BEARER = re.compile(r"\b((?:Bearer|Basic)\s+)([A-Za-z0-9\-._~+/]{8,}=*)")


def _http_credentials(text: str) -> str:
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + (MASK if m.group(2) != MASK else m.group(2)), text)
    return _BEARER.sub(lambda m: m.group(1) + MASK, text)


def _pairs(text: str) -> str:
    def pair(m: re.Match) -> str:
        group = next(g for g in ("dq", "sq", "bare") if m.group(g) is not None)
        value = m.group(group)
        start = m.start()
        vs, ve = m.span(group)
        name = m.group("name")
        lone = is_generic_name(name)
        before = re.search(r"([A-Za-z]+)[ \t]+$", text[:start])
        prose = lone and before is not None and before.group(1).lower() in PROSE_BEFORE
        if (is_secret_key(name) and not prose and value and value != MASK and not is_path(value)
                and (not lone or looks_like_credential(value))):
            replaced = MASK
        elif group != "bare":  # a quoted value may hold pairs of its own: --set cluster.env='{HF_TOKEN: ...}'
            replaced = _pairs(value)
        else:
            replaced = value
        return m.group(0)[: vs - start] + replaced + m.group(0)[ve - start:]

    return _PAIR.sub(pair, text)


def redact_value(key: Any, value: Any) -> Any:
    """One value under its key: *** when the key looks secret (and the value is set), else redact_mapping. Under a
    generic key (`key`, `token`) only a credential-looking value is masked: `{"key": "tp"}` stays."""
    if is_generic_name(key):
        return MASK if isinstance(value, str) and looks_like_credential(value) else redact_mapping(value)
    if is_secret_key(key) and isinstance(value, (list, tuple)):
        return type(value)(redact_value(key, v) for v in value)
    if (is_secret_key(key) and value not in (None, "", MASK) and not isinstance(value, (dict, list, tuple, bool))
            and not (isinstance(value, str) and (is_path(value) or _URI.fullmatch(value)))):
        return MASK
    return redact_mapping(value)


def redact_mapping(obj: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every secret masked (see redact_value, redact_text)."""
    if isinstance(obj, Mapping):
        return {k: redact_value(k, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_mapping(v) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
