"""Values a configuration file may hold that read well but could not work: each stops start-up with one line naming
the setting (exit code 2), not a traceback from deep in start-up, a setting silently taken as something else, or a
gateway that answers 500 later."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from gateway.envoy import free_ports
from server.cli import _taken_port, main
from server.config import ConfigError, load_config

ONE_MODEL = "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]"


def _model(provider: str, extra: str = "") -> str:
    return f"models: [{{id: a, endpoint: /v1/chat/completions, provider: {provider}{extra}}}]"


def _refusal(tmp_path, text: str, match: str | None = None) -> str:
    """The message load_config refuses a file holding `text` with (matching `match`)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path)
    return str(e.value)


def _upstream(base_url: str) -> str:
    return _model(f"{{kind: openai, base_url: '{base_url}', model: m}}")


MISTAKES = [
    # `kind: [openai]` was TypeError: unhashable type: 'list', a traceback.
    (_model("{kind: [openai]}"), r"models\[0\]\.provider: kind must be one of llamacpp, dev-image, openai, anthropic"),
    (_model("{kind: {openai: 1}}"), r"models\[0\]\.provider: kind must be one of"),
    # A port that is no port was urllib's ValueError, a traceback, once serve built the upstream's client ...
    (_upstream("http://127.0.0.1:abc/v1"), r"models\[0\]\.provider\.base_url: .*not 'http://127\.0\.0\.1:abc/v1'"),
    (_upstream("http://127.0.0.1:99999/v1"), r"models\[0\]\.provider\.base_url: .*99999"),
    # ... and a host with a space in it was a 502 on every request.
    (_upstream("http://up stream/v1"), r"models\[0\]\.provider\.base_url: "),
    (_upstream("http://[::1/v1"), r"models\[0\]\.provider\.base_url: "),  # urlsplit's ValueError, a traceback
    # The same for the other URLs: the Redis limit store (a traceback, or db `x` silently taken as 0), the tracing
    # collector (a traceback), PostgreSQL (a gateway started with its key store "unreachable") and image links.
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://127.0.0.1:abc/0'}}", r"limits\.store: not a URL \(.*port"),
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://:pw@[::1/0'}}", r"limits\.store: not a URL"),
    (f"{ONE_MODEL}\nkeys: {{store: 'postgresql://portico@[::1/portico'}}", r"keys\.store: not a URL"),
    # Neither a PostgreSQL URL nor readable: the message named no setting ("Invalid IPv6 URL").
    (f"{ONE_MODEL}\nkeys: {{store: 'mysql://:pw@[::1/x'}}", r"keys\.store: `sqlite` or a postgresql://.*not a URL"),
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://127.0.0.1:99999/0'}}", r"limits\.store: "),
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://127.0.0.1:6379/x'}}", r"limits\.store: "),
    (f"{ONE_MODEL}\nlimits: {{store: 'unix://'}}", r"limits\.store: "),
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://127.0.0.1/0?socket_timeout=soon'}}", r"limits\.store: "),
    # An option redis-py does not know (a typo) was passed on to its connection: TypeError at the first request.
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://:pw@127.0.0.1/0?socket_timout=1'}}",
     r"limits\.store: 'redis://:\*\*\*@127\.0\.0\.1/0\?socket_timout=1' has an option redis-py does not know: "
     r"socket_timout"),
    # A value redis-py's connection refuses as it is made (not with TypeError) was a traceback at start-up.
    (f"{ONE_MODEL}\nlimits: {{store: 'rediss://:pw@127.0.0.1/0?ssl_cert_reqs=bogus'}}",
     r"limits\.store: 'rediss://:\*\*\*@127\.0\.0\.1/0\?ssl_cert_reqs=bogus' has an option redis-py refuses: Invalid "
     r"SSL Certificate Requirements Flag: bogus"),
    (f"{ONE_MODEL}\nlimits: {{store: 'redis://127.0.0.1/0?protocol=9'}}",
     r"limits\.store: .* has an option redis-py refuses: protocol must be either 2 or 3"),
    (f"{ONE_MODEL}\ntracing: {{otlp_endpoint: 'http://127.0.0.1:abc'}}", r"tracing\.otlp_endpoint: "),
    # A blank service name was taken: every span exported under a service no backend's list shows legibly.
    (f"{ONE_MODEL}\ntracing: {{service_name: '   '}}", r"tracing\.service_name: a non-empty string, not '   '"),
    (f"{ONE_MODEL}\nkeys: {{store: 'postgresql://portico@db:abc/portico'}}", r"keys\.store: "),
    (f"{ONE_MODEL}\nlisten: {{public_base_url: 'https://portico.example.com:abc'}}", r"listen\.public_base_url: "),
    # An image link is the base URL with a path added: a query or fragment in it made every link wrong.
    (f"{ONE_MODEL}\nlisten: {{public_base_url: 'https://portico.example.com/?x=1'}}", r"listen\.public_base_url: "),
    # An empty query or fragment (a stray `?` or `#` at the end) was taken: every link was
    # `https://portico.example.com?/v1/images/content/...`, its path read as a query, so no link reached an image.
    (f"{ONE_MODEL}\nlisten: {{public_base_url: 'https://portico.example.com?'}}", r"listen\.public_base_url: "),
    (f"{ONE_MODEL}\nlisten: {{public_base_url: 'https://portico.example.com/portico#'}}", r"listen\.public_base_url: "),
    # `created` is a uint32 in every model listing: a larger one made GET /v1/models a 500.
    (f"models: [{{id: a, endpoint: /v1/messages, provider: {{kind: llamacpp}}, created: 5000000000}}]",
     r"models\[0\]\.created: a whole number from 0 to 4294967295, not 5000000000"),
    # A request's own max_tokens is at most 2147483647: the default is sent the same way (upstreams refuse more).
    (f"{ONE_MODEL}\ndefault_max_tokens: 3000000000",
     r"default_max_tokens: a whole number from 1 to 2147483647, not 3000000000"),
    # Default and per-model limits are bounded as a key's own are (api.md): a budget of 0 was silently no budget.
    (f"{ONE_MODEL}\nlimits: {{defaults: {{max_spend_day: 0}}}}",
     r"limits\.defaults\.max_spend_day: more than \$0 and at most \$1000000000\.00, or null for no limit, not 0"),
    (f"{ONE_MODEL}\nlimits: {{models: {{a: {{max_spend_month: 0.0}}}}}}", r"limits\.models\.a\.max_spend_month: "),
    # A negative budget was told "must be a non-negative number", and the 0 written next was refused in turn.
    (f"{ONE_MODEL}\nlimits: {{defaults: {{max_spend_day: -1}}}}",
     r"limits\.defaults\.max_spend_day: more than \$0 and at most \$1000000000\.00, or null for no limit, not -1"),
    (f"{ONE_MODEL}\nlimits: {{defaults: {{max_spend_month: 2000000000}}}}", r"limits\.defaults\.max_spend_month: "),
    (f"{ONE_MODEL}\nlimits: {{defaults: {{tokens_per_minute: 3000000000}}}}",
     r"limits\.defaults\.tokens_per_minute: a whole number from 1 to 2147483647, or null for no limit, "
     r"not 3000000000"),
    # CORS origins are compared byte for byte with the browser's `Origin`: one written otherwise never matched.
    (f"{ONE_MODEL}\ncors: {{allow_headers: [authorization]}}", r"cors\.allow_origins: required"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: []}}", r"cors\.allow_origins: a non-empty list of origins"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['https://app.example.com/']}}",
     r"cors\.allow_origins: 'https://app\.example\.com/' is not an origin as a browser sends it"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['https://App.example.com']}}", r"cors\.allow_origins: .*lower case"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: [app.example.com]}}",
     r"cors\.allow_origins: 'app\.example\.com' is not"),
    # A password written into an origin is not repeated: the message goes to logs.
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['https://ops:s3cret@app.example.com']}}",
     r"cors\.allow_origins: 'https://app\.example\.com' is not an origin .*no user or password"),
    # Envoy compares exactly: a pattern would match nothing.
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['https://*.example.com']}}", r"cors\.allow_origins: .* is not an origin"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['https://app.example.com:443']}}",
     r"cors\.allow_origins: .*default port.*write https://app\.example\.com"),
    # Browsers send a host in its ASCII (punycode) form and a port without leading zeros.
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['https://bücher.example']}}",
     r"cors\.allow_origins: 'https://bücher\.example' .*ASCII.*write https://xn--bcher-kva\.example"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['http://127.0.0.1:05173']}}",
     r"cors\.allow_origins: 'http://127\.0\.0\.1:05173' .*write http://127\.0\.0\.1:5173"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['*', 'https://app.example.com']}}", r"cors\.allow_origins: `\*`"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['*'], allow_headers: ['x-stainless-*']}}",
     r"cors\.allow_headers: 'x-stainless-\*' is not a header name"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['*'], expose_headers: ['x ratelimit']}}", r"cors\.expose_headers: "),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['*'], max_age_seconds: 100000}}",
     r"cors\.max_age_seconds: a whole number from 0 to 86400, not 100000"),
    (f"{ONE_MODEL}\ncors: {{allow_origins: ['*'], allow_methods: [DELETE]}}",
     r"cors: unknown setting\(s\) allow_methods"),
]


@pytest.mark.parametrize(("text", "message"), MISTAKES)
def test_a_value_that_cannot_work_is_a_configuration_error(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.parametrize(("text", "message"), MISTAKES[:3])
def test_serve_says_so_in_one_line_with_exit_code_2(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"{text}\naccess_log: off\n")  # capsys's stderr is no file an access log could share
    assert main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portico: configuration error: ") and err.count("\n") == 1
    assert not (tmp_path / "d").exists()  # nothing was started or created


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://:pw@cache.internal:6380/2", "redis://h",
                                 "unix:///run/redis.sock?db=1", "redis://127.0.0.1/3?socket_timeout=0.2"])
def test_redis_urls_as_redis_takes_them(tmp_path, url):
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nlimits: {{store: '{url}'}}")
    assert load_config(path).limits.store == url


def test_the_largest_limits_are_those_a_key_may_have(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\ndefault_max_tokens: 2147483647\nlimits: {{defaults: {{requests_per_minute: "
                    "2147483647, max_spend_day: 1000000000, max_spend_month: 0.000001}}")
    config = load_config(path)
    assert config.default_max_tokens == 2147483647
    defaults = config.limits.defaults
    assert (defaults.requests_per_minute, defaults.max_spend_day, defaults.max_spend_month) == (2147483647, 10**15, 1)


@pytest.mark.parametrize("setting", ["timeouts: {answer: 31536001}", "timeouts: {connect: 1.0e+12}",
                                     "retry: {total_seconds: 1.0e+300}", "retry: {max_backoff: 31536001}"])
def test_upstream_seconds_are_at_most_a_year(tmp_path, setting):
    """Envoy's limit on a silent request is made of them: 1e12 seconds was past what Envoy reads, and serve stopped
    with exit code 1 and a page of JSON."""
    path = tmp_path / "c.yaml"
    path.write_text(_model(f"{{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m, {setting}}}"))
    with pytest.raises(ConfigError, match=r"models\[0\]\.provider\.(timeouts|retry)\.\w+: a positive number of "
                                          r"seconds, at most 31536000 \(a year\), not "):
        load_config(path)


@pytest.mark.parametrize(("options", "text"), [
    (["--port", "18080", "--admin-port", "18080"], ""),
    (["--metrics-port", "18080"], "listen: {port: 18080}\n"),
    ([], "listen: {port: 18080}\nenvoy_admin_port: 18080\n"),
])
def test_one_port_for_two_listeners_is_a_configuration_error(tmp_path, capsys, options, text):
    """Two of Portico's own listeners on one port were exit code 1 after start-up had begun, with Envoy's `cannot bind
    ...: Address already in use`, which points at some other program."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: off\n{text}")
    assert main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portico: configuration error: ") and err.count("\n") == 1
    assert "18080" in err and "must differ" in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("option", ["--port", "--admin-port", "--metrics-port"])
def test_a_port_taken_by_another_program_is_one_line_naming_the_option(tmp_path, capsys, option):
    """`make serve` with 8080 taken (another server, or a Portico already running) loaded the model, then printed
    Envoy's five-line bind failure (or, for 9464, no hint of --metrics-port): now one line before anything starts."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: off\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        others = [str(p) for p in free_ports(2)]
        options = dict(zip([o for o in ("--port", "--admin-port", "--metrics-port") if o != option], others))
        options[option] = str(port)
        code = main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve",
                     *[text for pair in options.items() for text in pair]])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"portico: cannot bind '127.0.0.1:{port}': Address already in use")
    assert f"choose another with {option} N" in err
    assert not (tmp_path / "d").exists()


def test_an_address_not_of_this_machine_is_one_line_naming_host(tmp_path, capsys):
    """`serve --host 192.0.2.1` (an address no interface has: a typo, another host's) loaded the model, then printed
    Envoy's bind failure in five lines of its log (`[critical][main] ... goo.gle/debugproto ...`), naming no option."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: off\n")
    port, admin_port, metrics_port = free_ports(3)
    code = main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve", "--host", "192.0.2.1",
                 "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)])
    err = capsys.readouterr().err
    assert code == 1 and err == (f"portico: cannot bind '192.0.2.1:{port}': Cannot assign requested address: no "
                                 "network interface of this machine has the address 192.0.2.1; choose another with "
                                 "--host\n")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("host", ["fe80::1", "ff02::1"])
def test_an_address_no_socket_may_listen_on_is_one_line_naming_host(tmp_path, capsys, host):
    """A link-local IPv6 address without its interface (`fe80::1`, as `ip addr` lists it without `%eth0`) or a
    multicast one passed the check (the kernel says EINVAL, not EADDRNOTAVAIL): the model loaded, then Envoy's bind
    failure came in five lines of its log, exit code 1, naming no option."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\naccess_log: off\n")
    port, admin_port, metrics_port = free_ports(3)
    code = main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve", "--host", host,
                 "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"portico: cannot bind '[{host}]:{port}': Invalid argument: ")
    assert err.endswith("choose another with --host\n")
    assert not (tmp_path / "d").exists()


def test_a_port_that_needs_root_is_one_line_naming_the_option(tmp_path, monkeypatch):
    """Port 80 without root: Envoy's `Permission denied` came after the model loaded, in five lines of its log."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\n")

    def refused(self, address):  # this suite may run as root, which any port admits
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refused)
    config = load_config(path).with_overrides(port=80)
    assert _taken_port(config) == ("cannot bind '127.0.0.1:80': Permission denied: a port below 1024 needs root (or "
                                   "CAP_NET_BIND_SERVICE); choose another with --port N")


def test_an_ipv4_listener_on_the_port_stops_a_gateway_on_ipv6_any_before_it_starts(tmp_path):
    """Envoy's `::` listener takes IPv4 callers too (ipv4_compat, f22f645), so an IPv4 server on the same port stops
    it. The check still bound IPv6-only, as Envoy did before: it passed, the model loaded, and then Envoy failed
    with five lines of its own log and no word of --port. Now the check binds as Envoy does: one line, exit 1."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\n")
    admin_port, metrics_port = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = load_config(path).with_overrides(host="::", port=port, envoy_admin_port=admin_port,
                                                  metrics_port=metrics_port)
        refusal = _taken_port(config)
        assert refusal is not None and refusal.startswith(f"cannot bind '[::]:{port}': Address already in use")
        assert refusal.endswith("choose another with --port N")
        assert _taken_port(config.with_overrides(host="::1")) is None  # one address, IPv6 alone: beside it
        with socket.socket(socket.AF_INET6) as taken6:
            taken6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            taken6.bind(("::", port))
            taken6.listen()
            assert _taken_port(config).startswith(f"cannot bind '[::]:{port}': Address already in use")


def test_an_upstream_url_with_a_user_or_password_is_refused_without_echoing_it(tmp_path):
    """`https://user:secret@host/v1` was taken, and its user and password silently never sent (a 401, so a 502 for
    every caller), with a secret left in the file."""
    refused = _refusal(tmp_path, _upstream("https://user:s3cret-pw@api.example.com/v1"),
                       r"models\[0\]\.provider\.base_url: no user or password .*api_key_env")
    assert "s3cret-pw" not in refused
    refused = _refusal(tmp_path, _upstream("https://user:s3cret-pw@api.example.com:abc/v1"),  # and no URL at all
                       r"models\[0\]\.provider\.base_url: ")
    assert "s3cret-pw" not in refused


def test_a_public_base_url_with_a_user_or_password_is_refused_without_echoing_it(tmp_path):
    """It was taken, and every image link (`response_format: url`) then handed its password to every caller."""
    path = tmp_path / "c.yaml"
    for url in ("https://user:s3cret-pw@gw.example.com", "https://s3cret-pw@gw.example.com:abc"):
        path.write_text(f"listen: {{public_base_url: '{url}'}}\n{ONE_MODEL}\n")
        with pytest.raises(ConfigError, match=r"listen\.public_base_url: ") as e:
            load_config(path)
        assert "s3cret-pw" not in str(e.value)


@pytest.mark.parametrize("query", ["password=s3cret-pw", "sslmode=require&password=s3cret-pw", "sslpassword=s3cret-pw"])
def test_a_store_password_in_the_urls_query_is_refused_without_echoing_it(tmp_path, query):
    """libpq reads `?password=` as well as `user:password@`: the URL was taken, and every message or log line naming
    the store (it cannot be reached, say) showed the password."""
    refused = _refusal(tmp_path, f"{ONE_MODEL}\nkeys: {{store: 'postgresql://portico@db:5432/portico?{query}'}}\n",
                       r"keys\.store: no password in the URL .*keys\.password_env")
    assert "s3cret-pw" not in refused


def test_a_redis_password_in_the_urls_query_is_not_echoed(tmp_path):
    """redis-py takes `?password=` (the way to give one to a unix:// socket): a mistake elsewhere in the URL quoted
    it whole."""
    refused = _refusal(tmp_path, f"{ONE_MODEL}\nlimits: {{store: "
                                 "'unix:///run/redis.sock?password=s3cret-pw&socket_timeout=soon'}\n",
                       r"limits\.store: ")
    assert "s3cret-pw" not in refused and "password=***" in refused


def test_cors_is_off_unless_configured_and_takes_origins_as_browsers_send_them(tmp_path):
    path = tmp_path / "c.yaml"
    for text in ("", "\ncors:"):  # absent, or left empty (every line under it commented out)
        path.write_text(ONE_MODEL + text)
        assert load_config(path).cors is None
    path.write_text(f"{ONE_MODEL}\ncors: {{allow_origins: ['https://app.example.com', 'http://127.0.0.1:5173', "
                    "'chrome-extension://abcdef'], allow_headers: [Authorization, Content-Type], max_age_seconds: 0}")
    cors = load_config(path).cors
    assert cors.allow_origins == ("https://app.example.com", "http://127.0.0.1:5173", "chrome-extension://abcdef")
    assert cors.allow_headers == ("authorization", "content-type") and cors.max_age_seconds == 0
    assert "x-request-id" in cors.expose_headers and cors.allow_methods == ("GET", "POST")
    path.write_text(f"{ONE_MODEL}\ncors: {{allow_origins: '*', allow_headers: '*', expose_headers: '*'}}")
    cors = load_config(path).cors
    assert (cors.allow_origins, cors.allow_headers, cors.expose_headers) == (("*",), ("*",), ("*",))


@pytest.mark.parametrize("endpoint", ["http://otel:s3cret-pw@collector:99999/", "ftp://otel:s3cret-pw@collector/"])
def test_a_collector_password_in_a_refused_otlp_endpoint_is_not_echoed(tmp_path, endpoint):
    """A collector behind basic auth may be named with its credentials in the URL: a mistake elsewhere in it (a port
    out of range, another scheme) quoted the URL whole, password and all, on the line start-up fails with."""
    refused = _refusal(tmp_path, f"{ONE_MODEL}\ntracing: {{otlp_endpoint: '{endpoint}'}}\n",
                       r"tracing\.otlp_endpoint: an http:// or https:// URL")
    assert "s3cret-pw" not in refused and "otel:***@collector" in refused


def test_a_password_in_a_libpq_keyword_string_given_as_keys_store_is_not_echoed(tmp_path):
    """libpq also takes `host=db password=... dbname=portico`, which an operator may paste as keys.store: refused
    (a URL is asked for), the line quoted it whole, password and all."""
    refused = _refusal(tmp_path, f"{ONE_MODEL}\nkeys: {{store: "
                                 "'host=db user=portico password=s3cret-pw dbname=portico'}\n",
                       r"keys\.store: `sqlite` or a postgresql://")
    assert "s3cret-pw" not in refused and "password=***" in refused


def test_a_password_pasted_as_keys_password_env_is_not_echoed(tmp_path):
    """keys.password_env names the variable; the password itself pasted there was refused on a line quoting it (as
    the upstreams' api_key_env is not)."""
    refused = _refusal(tmp_path, f"{ONE_MODEL}\nkeys: {{store: 'postgresql://portico@db/portico', "
                                 "password_env: 's3cret-pw!'}\n",
                       r"keys\.password_env: the name of an environment variable")
    assert "s3cret-pw" not in refused


@pytest.mark.parametrize(("section", "url"), [
    ("limits: {store: '%s'}", "redis://:2024/YmFyQmF6@127.0.0.1:6379/0"),  # base64's `/`, not percent-encoded
    ("limits: {store: '%s'}", "redis://:Zm9v/YmFyQmF6@127.0.0.1:6379/0"),
    ("tracing: {otlp_endpoint: '%s'}", "http://otel:Zm9v/YmFyQmF6@collector:4318"),
    ("tracing: {otlp_endpoint: '%s'}", "https://otel:Zm9v#YmFyQmF6@collector"),
    ("tracing: {otlp_endpoint: '%s'}", "grpc://otel:Zm9v?YmFyQmF6@collector:4317"),
])
def test_a_password_holding_a_slash_a_question_mark_or_a_hash_is_not_echoed(tmp_path, section, url):
    """A generated password (`openssl rand -base64`, with its `/`) put in a URL unencoded ends the URL's host part
    early as urlsplit reads it, so the refusal quoted the URL whole, password and all (`tracing.otlp_endpoint: an
    http:// or https:// URL ..., not 'http://otel:Zm9v/YmFy...@collector:4318'`; a Redis URL whose password starts
    with digits: `... has a database that is no number`), on the line start-up fails with (a journal)."""
    refused = _refusal(tmp_path, f"{ONE_MODEL}\n{section % url}\n")
    assert "YmFyQmF6" not in refused, refused


def test_a_password_read_short_by_urlsplit_is_hidden_whole_where_the_store_is_named():
    """A URL start-up takes (redis-py reads `redis://:2024?...` as port 2024) is named in the log (`they share rate
    limits in ...`, the store's connection errors): its password hidden to its last character."""
    from server.limits.settings import redacted

    assert redacted("redis://:2024?YmFyQmF6@127.0.0.1:6379") == "redis://:***@127.0.0.1:6379"
    assert redacted("redis://u:Zm9v/Ym#Fy@h:6379/0?password=x") == "redis://u:***@h:6379/0?password=***"


# Upstream keys made only of letters, digits and `_` (Groq's gsk_..., Hugging Face's hf_..., a 64-digit hex key)
# and a password without punctuation are also well-formed variable names.
PASTED_CREDENTIALS = ["gsk_" + "Q7wErT1yU2iOp3AsD4fGh5JkL6zXc7VbN8mQw9Er0tYu1IoP2aSd",
                      "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789", "0f1e2d3c4b5a69788796a5b4c3d2e1f0" * 2]


@pytest.mark.parametrize("credential", PASTED_CREDENTIALS)
def test_an_upstream_key_pasted_as_api_key_env_is_refused_unechoed(tmp_path, capsys, credential):
    """`api_key_env: gsk_...` (the key where its variable's name goes) passed as a name, and `portico serve` then
    stopped on 'the environment variable gsk_Q7wE... (api_key_env of the upstream at ...) is not set or empty': the
    upstream key whole on stderr (a journal, a CI log). Such a value is now refused as no name, unquoted."""
    path = tmp_path / "c.yaml"
    path.write_text(_model(f"{{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m, api_key_env: {credential}}}")
                    + "\n")
    port, admin_port = free_ports(2)
    done = main(["--config", str(path), "--data-dir", str(tmp_path / "data"), "serve", "--port", str(port),
                 "--admin-port", str(admin_port), "--metrics-port", "0"])
    err = capsys.readouterr().err
    assert done == 2 and "api_key_env" in err, err
    assert credential[4:20] not in err, err


@pytest.mark.parametrize("password_env", ["Zm9vYmFyYmF6cXV4MTIzNDU2", PASTED_CREDENTIALS[0]])
def test_a_password_of_letters_and_digits_pasted_as_keys_password_env_is_not_echoed(tmp_path, password_env):
    """As for api_key_env: a password with no punctuation is a well-formed name, and start-up then said 'the
    environment variable Zm9vYmFy... is not set (it holds the password for ...)'."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{ONE_MODEL}\nkeys: {{store: 'postgresql://portico@db/portico', password_env: {password_env}}}\n")
    with pytest.raises(ConfigError, match=r"keys\.password_env: the name of an environment variable") as e:
        load_config(path).key_store.password()
    assert password_env[4:20] not in str(e.value)


@pytest.mark.parametrize(("name", "value", "what"), [
    ("ALL_PROXY", "socks5://porter:s3cret@127.0.0.1:1080", "a socks5:// proxy"),
    ("https_proxy", "http://127.0.0.1:99999", "no proxy URL"),
])
def test_a_proxy_portico_cannot_use_stops_serve_rather_than_being_passed_over(tmp_path, capsys, monkeypatch, name,
                                                                              value, what):
    """A SOCKS proxy (ALL_PROXY=socks5://..., as a desktop or a VPN sets it), or a proxy URL that is no URL, was
    passed over without a word: the upstream was asked directly, where only the proxy may reach it."""
    for variable in list(os.environ):
        if variable.lower().endswith("_proxy"):
            monkeypatch.delenv(variable)
    monkeypatch.setenv(name, value)
    path = tmp_path / "c.yaml"
    path.write_text("models: [{id: a, endpoint: /v1/messages, provider: {kind: openai, "
                    "base_url: 'https://upstream.example/v1', model: m}}]\naccess_log: off\n")
    port, admin_port, metrics_port = free_ports(3)
    code = main(["--config", str(path), "--data-dir", str(tmp_path / "d"), "serve", "--port", str(port),
                 "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("portico: configuration error: the proxy the environment names for "
                          "https://upstream.example/v1 (HTTPS_PROXY or ALL_PROXY, either case) is " + what)
    assert "s3cret" not in err
    assert not (tmp_path / "d").exists()
