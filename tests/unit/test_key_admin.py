"""KeyAdmin, the one key-admin service behind KeyService and `portico keys`: grants name models of the catalog."""

from __future__ import annotations

import sqlite3

import pytest

from server.cli import main
from server.errors import InvalidRequest
from server.keys import KeyAdmin, open_sqlite_key_store


@pytest.fixture
async def admin(tmp_path):
    store = await open_sqlite_key_store(tmp_path / "keys.db")
    yield KeyAdmin(store, ["family-a-5.5", "family-a-5.4"], rotation_grace_seconds=60)
    await store.close()


async def test_unknown_models_are_refused_on_create_and_update(admin):
    with pytest.raises(InvalidRequest, match="family-a-5.9") as caught:
        await admin.create("typo", all_models=False, models=["family-a-5.5", "family-a-5.9"])
    assert caught.value.param == "models"
    assert await admin.list() == ([], "")
    key, _ = await admin.create("ok", all_models=False, models=["family-a-5.5"])
    with pytest.raises(InvalidRequest, match="nope") as caught:
        await admin.update(key.id, grants=(False, ["nope"]))
    assert caught.value.param == "models"
    assert (await admin.get(key.id)).models == {"family-a-5.5"}
    assert (await admin.update(key.id, grants=(False, ["family-a-5.4"]))).models == {"family-a-5.4"}


async def test_an_empty_model_name_is_quoted_in_the_refusal(admin):
    """`"models": [""]` is refused saying which name is unknown: an empty one, shown as '' rather than nothing."""
    with pytest.raises(InvalidRequest, match="Unknown model\\(s\\): ''\\.") as caught:
        await admin.create("empty", all_models=False, models=[""])
    assert caught.value.param == "models"


async def test_rotation_uses_the_configured_grace_unless_given(admin):
    key, _ = await admin.create("r", all_models=True)
    _, _, expires = await admin.rotate(key.id)
    assert expires - (await admin.get(key.id)).created in range(59, 62)
    _, _, expires = await admin.rotate(key.id, grace_seconds=0)
    assert expires <= (await admin.get(key.id)).created + 1


def test_cli_refuses_unknown_models_through_the_same_service(tmp_path, capsys):
    code = main(["--data-dir", str(tmp_path), "keys", "create", "--name", "x", "--models", "family-a-9"])
    assert code == 2 and "family-a-9" in capsys.readouterr().err
    assert main(["--data-dir", str(tmp_path), "keys", "list"]) == 0
    assert capsys.readouterr().out == ""


def test_cli_says_which_catalog_refused_a_model_and_that_serve_s_config_is_the_one(tmp_path, capsys):
    """A gateway started with `--config my.yaml` serves models server/default.yaml lacks; `portico keys create`
    without that option refused them as "Unknown", pointing only at GET /v1/models, which does list them."""
    code = main(["--data-dir", str(tmp_path), "keys", "create", "--name", "x", "--models", "family-a-local"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "server/default.yaml" in err and "--config" in err

@pytest.mark.parametrize("models", ["", " , "])
def test_cli_update_with_no_model_in_models_is_refused_as_create_refuses_it(tmp_path, capsys, models):
    """`keys update ID --models "$MODELS"` with an empty variable said "Updated" (exit 0) and changed nothing."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "x", "--models", "family-a-5.5"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    assert main([*data, "keys", "update", key_id, "--models", models]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portico: Grant the key some models") and err.count("\n") == 1, err
    assert main([*data, "keys", "create", "--name", "y", "--models", models]) == 2
    assert capsys.readouterr().err == err


@pytest.mark.parametrize("command", ["create", "update"])
def test_cli_models_given_twice_grants_both_not_the_last_alone(tmp_path, capsys, command):
    """`keys create --models family-a-5.5 --models family-a-5.4` (or `--model` twice, which argparse reads as
    --models) said "Created" and granted family-a-5.4 alone: the first model's calls were then 404 model_not_found
    for an operator who had granted it. Each --models adds its models, as `usage --model` does."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "x", "--models", "family-a-5.5"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    twice = ["--models", "family-a-5.5", "--model", "family-a-5.4,family-b-opus-4-8"]
    if command == "create":
        assert main([*data, "keys", "create", "--name", "y", *twice]) == 0
        key_id = capsys.readouterr().out.split()[2]
    else:
        assert main([*data, "keys", "update", key_id, *twice]) == 0
        capsys.readouterr()
    assert main([*data, "keys", "get", key_id]) == 0
    assert capsys.readouterr().out.splitlines()[0].split("\t")[4] == "family-a-5.4,family-a-5.5,family-b-opus-4-8"


@pytest.mark.parametrize("options, param", [
    (["--env", "my prod"], "env"),
    (["--env", "ünï"], "env"),
    (["--name", "two\nlines"], "name"),
    (["--max-spend-month", "1e20"], "max_spend_month"),
    (["--max-spend-day", "0.0000001"], "max_spend_day"),
    (["--max-spend-day", "five"], "max_spend_day"),
    (["--rpm", "99999999999999999999"], "requests_per_minute"),
])
def test_cli_refuses_a_bad_env_name_or_limit_in_one_line(tmp_path, capsys, options, param):
    """A traceback (42 lines for --max-spend-month 1e20) became one line naming the field, with exit code 2, and the
    option the user typed (the field's API name alone left them to guess that `requests_per_minute` is --rpm)."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "x", "--all-models", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"portico: {options[0]}: {param}") and err.count("\n") == 1, err
    assert main([*data, "keys", "create", "--name", "x", "--all-models"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    assert main([*data, "keys", "update", key_id, *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"portico: {options[0]}: {param}") and err.count("\n") == 1, err


@pytest.mark.parametrize("command, bounds", [
    (["create", "--name", "y", "--all-models"], "more than $0 and at most $1000000000.00"),
    (["update", "ID"], "more than $0 (0 removes the key's own limit) and at most $1000000000.00"),
])
def test_cli_refuses_a_negative_budget_naming_its_bounds(tmp_path, capsys, command, bounds):
    """`--max-spend-day -1` was told "must be a non-negative number of US dollars", and the 0 typed next was refused
    by `create` in turn: a negative budget names the bounds, as a negative --rpm does."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "x", "--all-models"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    command = [key_id if word == "ID" else word for word in command]
    assert main([*data, "keys", *command, "--max-spend-day=-1"]) == 2
    assert capsys.readouterr().err == f"portico: --max-spend-day: max_spend_day must be {bounds}.\n"


@pytest.mark.parametrize("grace", ["-1", "315360001", "4294967295"])
def test_cli_refuses_a_rotation_grace_out_of_range_as_rest_does(tmp_path, capsys, grace):
    """`--grace -1` ended the previous secret at once and said so with exit 0; REST refuses such a value."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "x", "--all-models"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    assert main([*data, "keys", "rotate", key_id, "--grace", grace]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portico: --grace: grace_seconds must be") and err.count("\n") == 1, err


def test_cli_rotation_without_grace_says_the_previous_secret_stops_now(tmp_path, capsys):
    """`--grace 0` said the previous secret "works until" the current second."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "x", "--all-models"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    assert main([*data, "keys", "rotate", key_id, "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "works until" not in out and "the previous secret stops working within seconds" in out, out
    assert main([*data, "keys", "rotate", key_id, "--grace", "60"]) == 0
    assert "the previous secret works until" in capsys.readouterr().out


def test_keys_on_a_locked_database_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """Another process holding keys.db's write lock past the busy timeout: `portico keys list` raised sqlite3's
    OperationalError from the key store's schema check, a traceback where a PostgreSQL outage gets one line."""
    assert main(["--data-dir", str(tmp_path), "keys", "create", "--name", "n", "--all-models"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("server.db.sqlite.BUSY_TIMEOUT_MS", 50)
    holder = sqlite3.connect(tmp_path / "keys.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert main(["--data-dir", str(tmp_path), "keys", "list"]) == 1
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"portico: the key store {tmp_path / 'keys.db'} cannot be reached: SQLite: database is locked\n"


def test_cli_gets_one_key_with_its_limits_as_keyservice_does(tmp_path, capsys):
    """KeyService has GetKey and the CLI was to offer the same operations, but there was no `portico keys get`: a
    key's own limits and budgets could not be read from the command line at all (`keys list` shows no limits)."""
    data = ["--data-dir", str(tmp_path)]
    assert main([*data, "keys", "create", "--name", "billing", "--models", "family-a-5.5", "--env", "prod",
                 "--rpm", "60", "--max-spend-day", "5"]) == 0
    key_id = capsys.readouterr().out.split()[2]
    assert main([*data, "keys", "get", key_id]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{key_id}\tbilling\tactive\tprod\tfamily-a-5.5"
    assert "requests_per_minute=60" in out and "max_spend_day=$5.00" in out
    assert main([*data, "keys", "revoke", key_id]) == 0
    capsys.readouterr()
    assert main([*data, "keys", "get", key_id]) == 0
    assert capsys.readouterr().out.splitlines()[0].split("\t")[2] == "revoked"
    assert main([*data, "keys", "get", "key_nope"]) == 1
    assert capsys.readouterr().err == "portico: No key with id 'key_nope'.\n"


@pytest.mark.parametrize("pasted", ["{secret}\n", " {secret}", "{secret} ", "\t{secret}\r\n"])
async def test_a_leaked_secret_pasted_with_space_or_a_line_end_around_it_is_revoked(admin, pasted):
    """A leaked secret copied with what came around it (a line's end, a space before it) was answered "No key has
    that secret." (or "No key with id ' pk-...'"), while its key went on working: an operator revoking in a hurry
    read that the secret was no key's. A secret or id never holds whitespace: what is around it is not read."""
    key, secret = await admin.create("leaked", all_models=True)
    revoked = await admin.revoke(pasted.format(secret=secret))
    assert revoked.id == key.id and revoked.revoked_at > 0


async def test_a_secret_where_a_key_id_goes_says_so_not_that_no_key_has_it(admin, tmp_path, capsys):
    """`portico keys get pk-...` (an operator finding which key a leaked secret is) answered "No key with id
    'pk-[redacted]'.", read as "this secret is no key's", while the key went on working; update and rotate the same.
    Only revoke takes a secret: the others now say so, never quoting it."""
    key, secret = await admin.create("leaked", all_models=True)
    message = "id takes a key id (key_...), not a key's secret (pk-...); only revoke takes a secret."
    for call in (admin.get(secret), admin.update(secret, name="x"), admin.rotate(secret)):
        with pytest.raises(InvalidRequest) as caught:
            await call
        assert (caught.value.message, caught.value.param) == (message, "id")
    assert (await admin.get(key.id)).name == "leaked"


@pytest.mark.parametrize("pasted", [" {secret}", "\t{secret}\n", "{secret} "])
async def test_a_secret_pasted_with_space_around_it_where_a_key_id_goes_says_so_too(admin, pasted):
    """With a space before it (a copy from a log line), `GET /v1/admin/keys/%20pk-...`, PATCH, rotate and the limits
    answered 404 "No key with id ' pk-[redacted]'", read as "no key has this secret", where api.md promises the 400
    that says only revoke takes a secret (and revoke takes it so pasted)."""
    key, secret = await admin.create("leaked", all_models=True)
    for call in (admin.get(pasted.format(secret=secret)), admin.update(pasted.format(secret=secret), name="x"),
                 admin.rotate(pasted.format(secret=secret))):
        with pytest.raises(InvalidRequest, match="not a key's secret") as caught:
            await call
        assert caught.value.param == "id"
    assert (await admin.get(key.id)).name == "leaked"


@pytest.mark.parametrize("pasted", [" {key_id}", "\t{key_id}\n", "{key_id} "])
async def test_a_key_id_pasted_with_space_around_it_finds_its_key_as_revoke_does(admin, pasted):
    """A key id copied from a log line or a terminal (a space before it, a line's end after it): GET, PATCH, rotate
    and the limits answered 404 "No key with id ' key_...'", while revoke, given the same id, found the key."""
    key, _ = await admin.create("spaced", all_models=True)
    given = pasted.format(key_id=key.id)
    assert (await admin.get(given)).id == key.id
    assert (await admin.update(given, name="renamed")).name == "renamed"
    rotated, _, _ = await admin.rotate(given, grace_seconds=0)
    assert rotated.id == key.id
    assert (await admin.revoke(given)).revoked_at > 0
