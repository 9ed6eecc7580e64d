"""Redaction: the one owner of what the kit hides when it prints, logs or records a request, an environment, a
config or a URI (dry runs, the launch record, trackers' params, error lines and failure files).

Hidden:
- credentials in a URI: `user:password@` (dropped, so the URI still names the server) and the values of secret
  query parameters (`token=`, `sig=`, `X-Amz-Signature=`, `X-Amz-Credential=`, ...);
- the value of a secret name (an environment variable, a config key, a `--flag`): a name is secret when one of its
  words (split at `_`, `-`, `.` and lower-to-upper case changes) is SECRET, PASSWORD, PASSWD, CREDENTIAL(S),
  PRIVATE, APIKEY or AUTHORIZATION, or when its last word is TOKEN, KEY, PAT, AUTH, SIG, SIGNATURE, PASS,
  COOKIE or SESSION, or it ends in KEY_ID. The weak words count last only, so that `tokenizer`,
  `KEY_COLUMN`, `max_tokens`, `PATH` and `TOKENIZERS_PARALLELISM` stay readable while `HF_TOKEN`,
  `WANDB_API_KEY`, `GITHUB_PAT`, `HF_AUTH` and `AWS_ACCESS_KEY_ID` are hidden.
- an AWS account id inside an ARN (all but its last 4 digits).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
_STRONG_WORDS = {
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "CREDENTIALS",
    "PRIVATE",
    "APIKEY",
    "AUTHORIZATION",
}
_LAST_WORDS = {"TOKEN", "KEY", "PAT", "AUTH", "SIG", "SIGNATURE", "PASS", "COOKIE", "SESSION"}
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# scheme://... up to whitespace, a quote or a parenthesis, less a sentence's closing punctuation: a URI inside a line of text (a log line, a command, an error).
_URI_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]*[^\s'\"<>().,;:!?]")
# --name VALUE or --name=VALUE, and NAME=VALUE: a secret's value inside a line of text.
_FLAG_IN_TEXT = re.compile(
    r"(?<![\w-])(--?)([A-Za-z][A-Za-z0-9_.-]*)(=|[ \t]+)(?!-)([^\s'\"()<>,;]*[^\s'\"()<>,;:.!?])"
)
_ASSIGN_IN_TEXT = re.compile(r"(?<![\w/.-])([A-Za-z_][A-Za-z0-9_]*)=([^\s'\"()<>,;]*[^\s'\"()<>,;:.!?])")
_ARN_ACCOUNT = re.compile(r"(arn:[^:\s]*:[^:\s]*:[^:\s]*:)\d{8}(\d{4}):")


def is_secret_name(name: str) -> bool:
    """Whether the value named `name` (an environment variable, a config key or flag, a query parameter) is a
    secret by its name."""
    words = [w.upper() for w in _WORD.findall(name)]
    if not words:
        return False
    if any(w in _STRONG_WORDS for w in words):
        return True
    return words[-1] in _LAST_WORDS or (len(words) > 1 and words[-2:] == ["KEY", "ID"])


def uri(text: str) -> str:
    """The URI without user:password and with secret query values masked; anything else unchanged."""
    try:
        parts = urlsplit(text)
        user_info = parts.username is not None or parts.password is not None
        _ = parts.port  # a malformed port raises here, not later
    except ValueError:
        return text
    netloc = parts.netloc.rpartition("@")[2] if user_info else parts.netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_name(k) for k, _ in pairs):
            query = urlencode([(k, MASK if is_secret_name(k) else v) for k, v in pairs], safe="*/:")
    if netloc == parts.netloc and query == parts.query:
        return text
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def arn(text: str) -> str:
    """An ARN with its account id masked: arn:aws:iam::****9012:role/Name."""
    return _ARN_ACCOUNT.sub(r"\1****\2:", text)


def text(line: str) -> str:
    """A line of free text (a log line, a command line, an error) with URIs' credentials, secret flags' and
    secret NAME=VALUE assignments' values masked."""
    line = _URI_IN_TEXT.sub(lambda m: uri(m.group(0)), line)
    line = _FLAG_IN_TEXT.sub(
        lambda m: m.group(0) if not is_secret_name(m.group(2)) else f"{m[1]}{m[2]}{m[3]}{MASK}", line
    )
    return _ASSIGN_IN_TEXT.sub(lambda m: f"{m[1]}={MASK}" if _secret_assignment(m[1]) else m.group(0), line)


def _secret_assignment(name: str) -> bool:
    # NAME=VALUE in prose: an environment variable or a snake_case key (HF_TOKEN=x, api_key=x), not a placeholder
    # of a sentence (`write it as key=value`, `use KEY=V1,V2`).
    return "_" in name and is_secret_name(name)


def value(name: str, item: Any) -> Any:
    """The value of `name`, redacted: masked when the name is secret, else with its URIs' credentials hidden."""
    if item is None or item == "":
        return item
    if is_secret_name(name) and not isinstance(item, dict | list | bool):
        return MASK
    return tree(item)


def tree(data: Any) -> Any:
    """A copy of a config tree, environment or request (dicts, lists, scalars) with every secret hidden: values
    of secret keys masked, credentials in every string removed."""
    if isinstance(data, dict):
        return {k: value(str(k), v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [tree(v) for v in data]
    if isinstance(data, str):
        return text(data)
    return data


def arguments(argv: list[str]) -> list[str]:
    """Command-line arguments with the value of every secret flag (`--hf_token X`, `--hf_token=X`) masked and
    credentials in every URI removed."""
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next:
            out.append(MASK)
            secret_next = False
            continue
        name, sep, _ = arg.lstrip("-").partition("=")
        if arg.startswith("-") and is_secret_name(name):
            if sep:
                out.append(f"{arg.split('=', 1)[0]}={MASK}")
            else:
                out.append(arg)
                secret_next = True
            continue
        out.append(uri(arg) if "://" in arg else arg)
    return out
