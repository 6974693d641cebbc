"""`portico keys ...` and `portico usage`: the commands that work on the stores (the configured key store and the
usage ledger) rather than run the gateway; server/cli.py parses them and hands them over."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import re
import sys
import time

from server.config import Config
from server.db.database import StoreUnavailable
from server.domain_keys import SPEND_LIMIT_NAMES, ApiKey, KeyLimits
from server.errors import InvalidRequest, redact_secrets
from server.keys import KeyAdmin, open_key_store
from server.usage.money import usd_text, usd_to_micros
from server.usage.report import add_arguments as add_usage_arguments
from server.usage.report import query_of as usage_query
from server.usage.report import table as usage_table
from server.usage.stores import open_ledger


def add_store_commands(commands: argparse._SubParsersAction, after: argparse.ArgumentParser) -> None:
    """The `usage` and `keys` commands; `after` holds the global options, which may follow a command too."""
    usage = commands.add_parser("usage", parents=[after],
                                help="usage and spend per bucket (and model, key or env) from the ledger")
    add_usage_arguments(usage)
    keys = commands.add_parser("keys", help="create, update, rotate, list, get and revoke API keys").add_subparsers(
        dest="keys_command", required=True
    )
    create = keys.add_parser("create", parents=[after],
                             help="create a key; its secret is printed on the last line, once")
    create.add_argument("--name", required=True)
    grant = create.add_mutually_exclusive_group(required=True)
    grant.add_argument("--all-models", action="store_true", help="grant every model, including ones added later")
    # append: a second --models adds its models (as `usage --model` does); argparse's default kept the last alone
    grant.add_argument("--models", action="append", help="comma-separated model ids (repeatable)")
    _limit_options(create, "")
    create.add_argument("--env", default="", help="environment or business line label, e.g. prod")
    create.add_argument("--admin", action="store_true",
                        help="may call the admin API (keys, their limits, the catalog), sign in to the console and "
                             "read every key's usage")
    update = keys.add_parser("update", parents=[after],
                             help="change a key's limits, grants, name or label (0 removes a limit)")
    update.add_argument("key", metavar="ID")
    update.add_argument("--name")
    grant = update.add_mutually_exclusive_group()
    grant.add_argument("--all-models", action="store_true", help="grant every model")
    grant.add_argument("--models", action="append", help="grant exactly these comma-separated model ids (repeatable)")
    _limit_options(update, " (0: back to the configured default)")
    update.add_argument("--env", help="environment or business line label")
    rotate = keys.add_parser("rotate", parents=[after], help="give a key a new secret, printed on the last line, once")
    rotate.add_argument("key", metavar="ID")
    rotate.add_argument("--grace", type=int, metavar="SECONDS",
                        help="how long the current secret keeps working (default keys.rotation_grace_seconds)")
    keys.add_parser("list", parents=[after], help="list keys (ids, names, grants; never secrets)")
    get = keys.add_parser("get", parents=[after], help="one key as `list` shows it, then its own limits and budgets")
    get.add_argument("key", metavar="ID")
    revoke = keys.add_parser("revoke", parents=[after], help="revoke a key by id or by its secret")
    revoke.add_argument("key", metavar="ID_OR_SECRET")


# U+202A-U+202E and U+2066-U+2069, as the console's dom.js `shown`; and the line and paragraph separators, U+2028
# and U+2029, which split a name's row in two for a script reading the rows with str.splitlines()
_DIRECTIONAL = re.compile("[\u202a-\u202e\u2066-\u2069\u2028\u2029]")

# option -> KeyLimits field
_LIMIT_OPTIONS = {
    "rpm": ("requests_per_minute", "requests per minute"),
    "tpm": ("tokens_per_minute", "tokens per minute"),
    "concurrency": ("concurrent_requests", "concurrent requests"),
    "daily_tokens": ("daily_tokens", "tokens per UTC day"),
    "daily_requests": ("daily_requests", "requests per UTC day"),
    "max_spend_day": ("max_spend_day", "budget in US dollars per UTC day, e.g. 5 or 0.25"),
    "max_spend_month": ("max_spend_month", "budget in US dollars per UTC calendar month, e.g. 100"),
}


def _option_of(param: str | None) -> str | None:
    """The `keys` option that sets an API field (a refusal names the field: `requests_per_minute` is --rpm)."""
    options = {field: f"--{option.replace('_', '-')}" for option, (field, _) in _LIMIT_OPTIONS.items()}
    field = (param or "").removeprefix("limits.")  # the store names a limit by its place in the key's JSON
    return {**options, "name": "--name", "env": "--env", "grace_seconds": "--grace"}.get(field)


def _limit_options(parser: argparse.ArgumentParser, note: str) -> None:
    for option, (field, meaning) in _LIMIT_OPTIONS.items():
        kind = str if field in SPEND_LIMIT_NAMES else int  # budgets: read in _limits_given, checked like the rest
        parser.add_argument(f"--{option.replace('_', '-')}", type=kind, help=meaning + note)


def _limits_given(args: argparse.Namespace) -> dict[str, int]:
    """The limits given, budgets in micro-dollars. A budget that is no amount of dollars is refused in one line
    naming it (InvalidRequest), as a limit out of range is, not with argparse's usage text."""
    given = {}
    for option, (field, _) in _LIMIT_OPTIONS.items():
        if (value := getattr(args, option)) is not None:
            try:
                given[field] = usd_to_micros(value, field, signed=True) if field in SPEND_LIMIT_NAMES else value
            except ValueError as exc:
                raise InvalidRequest(str(exc), param=field) from None
    return given


def usage_arguments_refused(args: argparse.Namespace) -> int:
    """2, said in one line, when `usage`'s own options are wrong (before the ledger is looked for); else 0."""
    try:
        usage_query(args)
    except argparse.ArgumentTypeError as exc:
        print(f"portico: {redact_secrets(str(exc))}", file=sys.stderr)
        return 2
    return 0


def usage_command(args: argparse.Namespace, config: Config) -> int:
    query = usage_query(args)  # its options were checked before the ledger was looked for (usage_arguments_refused)
    try:
        ledger = open_ledger(config.key_database)
    except StoreUnavailable as exc:
        return unreachable(f"the usage ledger in {config.key_database.described}", exc)
    try:
        print("\n".join(usage_table(query, ledger.aggregate(query))))
    except StoreUnavailable as exc:
        return unreachable(f"the usage ledger in {config.key_database.described}", exc)
    finally:
        ledger.close()
    return 0


def unreachable(what: str, exc: StoreUnavailable) -> int:
    """One line (libpq adds a hint on a line of its own), and a failing exit status."""
    print(f"portico: {what} cannot be reached: {str(exc).splitlines()[0]}", file=sys.stderr)
    return 1


def keys_command(args: argparse.Namespace, config: Config) -> int:
    """Against the configured store (keys.store): the same keys as every host using that configuration."""
    return asyncio.run(_keys_in_store(args, config))


async def _keys_in_store(args: argparse.Namespace, config: Config) -> int:
    try:
        store = await open_key_store(config.key_database)
    except StoreUnavailable as exc:
        return unreachable(f"the key store {config.key_database.described}", exc)
    admin = KeyAdmin(store, [entry.id for entry in config.models],
                     rotation_grace_seconds=config.key_rotation_grace_seconds)
    try:
        return await _keys_command(args, admin)
    except InvalidRequest as exc:  # a mistake in the command's options, like argparse's own
        message = exc.message
        if (option := _option_of(exc.param)) is not None:
            message = f"{option}: {message}"
        if message.startswith("Unknown model"):  # a gateway started with --config may serve models this one lacks
            message += (f" The catalog checked is {args.config or 'server/default.yaml'}: give `keys` the --config "
                        "that `serve` runs with.")
        print(f"portico: {message}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:
        return unreachable(f"the key store {config.key_database.described}", exc)
    finally:
        await store.close()


async def _keys_command(args: argparse.Namespace, admin: KeyAdmin) -> int:
    models = [m.strip() for m in ",".join(getattr(args, "models", None) or []).split(",") if m.strip()]
    if args.keys_command == "create":
        limits = KeyLimits(**_limits_given(args))
        key, secret = await admin.create(
            args.name, all_models=args.all_models, models=models, limits=limits, env=args.env, admin=args.admin
        )
        lines = [f"Created key {key.id} ({_shown(key.name)}). Its secret is shown once:", secret]
        return _print_secret(lines, f"created key {key.id} ({_shown(key.name)}), but its secret",
                             f"revoke it (portico keys revoke {key.id}) and create another")
    elif args.keys_command == "list":
        keys, _ = await admin.list()
        for key in keys:
            print(_row(key))
    elif args.keys_command == "get":
        key = await admin.get(args.key)
        print(_row(key))
        print(f"limits: {_limits_text(key)}")
    elif args.keys_command == "update":
        # --models given with no model in it is refused (as by create), not taken as "no change"
        grants = (args.all_models, models) if args.all_models or args.models is not None else None
        limits = {field: value or None for field, value in _limits_given(args).items()}  # 0 removes
        key = await admin.update(args.key, name=args.name, grants=grants, limits=limits, env=args.env)
        print(f"Updated key {key.id} ({_shown(key.name)}): {_describe(key)}")
    elif args.keys_command == "rotate":
        key, secret, expires = await admin.rotate(args.key, grace_seconds=args.grace)
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
        # No grace: the gateways' key caches drop the previous secret within seconds (as after a revocation).
        previous = ("the previous secret stops working within seconds" if expires <= time.time() else
                    f"the previous secret works until {when}")
        lines = [f"Rotated key {key.id} ({_shown(key.name)}); {previous}. The new secret is shown once:", secret]
        return _print_secret(lines, f"rotated key {key.id} ({_shown(key.name)}), but its new secret",
                             "rotate it again")
    elif args.keys_command == "revoke":
        key = await admin.revoke(args.key)
        print(f"Revoked key {key.id} ({_shown(key.name)}).")
    return 0


def _print_secret(lines: list[str], lost: str, remedy: str) -> int:
    """A secret's lines, written out now: when they cannot be (a full disk under `> secret.txt`, a closed pipe), the
    key is made or rotated all the same and its secret is gone, so say which key and what to do, in one line."""
    try:
        print("\n".join(lines))
        flush_stdout()
    except OSError as exc:
        discard_stdout()
        print(f"portico: {lost} could not be written ({exc.strerror}): {remedy}", file=sys.stderr)
        return 1
    return 0


def flush_stdout() -> None:
    """sys.stdout.flush(); a closed stdout (`>&-`: Python's is None, and print() writes nothing, without a word) is
    an error, as a full disk is."""
    if sys.stdout is None:
        raise OSError(errno.EBADF, "stdout is closed")
    sys.stdout.flush()


def discard_stdout() -> None:
    """After a write to stdout failed: what is still buffered would fail again, as a traceback, at exit (a closed
    one: the next flush would say so again)."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # the process's stdout from now on
    else:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _limit_text(field: str, value: int) -> str:
    return usd_text(value) if field in SPEND_LIMIT_NAMES else str(value)


def _grants(key: ApiKey) -> str:
    return "all models" if key.all_models else ",".join(sorted(key.models))


def _shown(name: str) -> str:
    """A key name with its directional embeddings, overrides and isolates written out as <U+202E>, as the console
    shows them: printed raw, a right-to-left override reverses the rest of the terminal line and disguises the name.
    Its line and paragraph separators likewise (<U+2028>): each key is one line."""
    return _DIRECTIONAL.sub(lambda match: f"<U+{ord(match.group()):04X}>", name)


def _row(key: ApiKey) -> str:
    """A key's line in `keys list` and `keys get`: id, name, state, env, grants (tab-separated)."""
    state = "revoked" if key.revoked_at else "active"
    role = " admin" if key.admin else ""
    return f"{key.id}\t{_shown(key.name)}\t{state}{role}\t{key.env or '-'}\t{_grants(key)}"


def _limits_text(key: ApiKey) -> str:
    limits = ", ".join(f"{f}={_limit_text(f, value)}" for f, _ in _LIMIT_OPTIONS.values()
                       if (value := getattr(key.limits, f)) is not None)
    return limits or "configured defaults"


def _describe(key: ApiKey) -> str:
    return f"{_grants(key)}; limits: {_limits_text(key)}"
