"""A login page for Locust's web UI, on where compose publishes it beyond loopback.

Locust's web UI has no login of its own: whoever reaches it can start a swarm against any ``host=``, an open load
generator. Its ``--web-login`` puts every page behind flask-login and leaves the login itself to the locustfile;
this module is that login: one user, ``kvstorm``, whose password is ``$KVSTORM_LOCUST_PASSWORD`` (compared in
constant time, never logged). There is no committed password: with the login on and none set, the master refuses
to start.

The web UI binds 127.0.0.1 unless ``--web-host`` says otherwise (Locust's own default is every interface). The login
is on by default wherever the UI may be reached from another machine: the web host Locust finally parsed (from the
command line, ``$LOCUST_WEB_HOST`` or a config file such as ``locust.conf``: whatever set it) beyond loopback, unless
the deployment says its ports are published on loopback only (compose passes ``$KVSTORM_PUBLISHED_ON``,
``${KVSTORM_BIND_ADDRESS:-127.0.0.1}``, into the containers: the same rule kvstorm/exposure.py applies to the engine
and the controller). ``--web-login`` (``$LOCUST_WEB_LOGIN``) turns it on anywhere else. flask is imported only when
the login is installed; nothing here imports locust.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import sys
from collections.abc import Mapping

PUBLISHED_ON_ENV = "KVSTORM_PUBLISHED_ON"
LOOPBACK = "127.0.0.1"
PASSWORD_ENV = "KVSTORM_LOCUST_PASSWORD"
USERNAME = "kvstorm"
CALLBACK_PATH = "/kvstorm-login"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; anything else (0.0.0.0, ::, a LAN address, a name) may be reached from outside."""
    host = host.strip().strip("[]").lower()
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_published_beyond_loopback(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the deployment says its ports are published on an address beyond loopback."""
    published_on = environ.get(PUBLISHED_ON_ENV, "")
    return bool(published_on) and not is_loopback(published_on)


def add_arguments(parser) -> None:
    """The web UI on loopback by default (a config file, ``$LOCUST_WEB_HOST`` or ``--web-host`` may say otherwise)."""
    parser.set_defaults(web_host=LOOPBACK)


def is_web_ui_exposed(web_host: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a web UI bound to ``web_host`` may be reached from another machine (see the module's docstring)."""
    if is_published_beyond_loopback(environ):
        return True
    published_on = environ.get(PUBLISHED_ON_ENV, "")
    return not is_loopback(web_host) and not (published_on and is_loopback(published_on))


def install(web_ui, environ: Mapping[str, str] = os.environ) -> None:
    """The login on a web UI started with ``--web-login`` or bound where it may be reached (``web_ui.host``: the
    address Locust binds, decided on its final options), its form's handler and user loader; nothing otherwise.

    Exits (``SystemExit`` with the reason) when the login is on and ``$KVSTORM_LOCUST_PASSWORD`` is empty."""
    if not web_ui.web_login and is_web_ui_exposed(web_ui.host, environ):
        _switch_login_on(web_ui)
    if not web_ui.web_login:
        return
    password = environ.get(PASSWORD_ENV, "")
    if not password:
        sys.exit(
            f"locust: refusing to start: the web UI's login is on (--web-login, a web host beyond loopback: "
            f"{web_ui.host or 'every interface'}, or ${PUBLISHED_ON_ENV} beyond loopback) and ${PASSWORD_ENV} is "
            "empty. Set one, e.g.\n"
            f'    sed -i "s/^{PASSWORD_ENV}=.*/{PASSWORD_ENV}=$(openssl rand -hex 16)/" kvstorm.env\n'
            f"and log in as {USERNAME!r} with it."
        )
    from flask import Blueprint, redirect, request, session, url_for
    from flask_login import UserMixin, login_user

    class User(UserMixin):
        def __init__(self, user_id: str) -> None:
            self.id = user_id

    web_ui.app.secret_key = secrets.token_hex(32)  # sessions last as long as this master
    web_ui.login_manager.user_loader(lambda user_id: User(user_id) if user_id == USERNAME else None)
    web_ui.auth_args = {"username_password_callback": CALLBACK_PATH}
    blueprint = Blueprint("kvstorm_login", __name__)

    @blueprint.route(CALLBACK_PATH, methods=["POST"])
    def submit():
        given_user = request.form.get("username", "").encode()
        given_password = request.form.get("password", "").encode()
        user_ok = hmac.compare_digest(given_user, USERNAME.encode())
        password_ok = hmac.compare_digest(given_password, password.encode())
        if user_ok and password_ok:
            login_user(User(USERNAME))
            return redirect(url_for("locust.index"))
        session["auth_error"] = "wrong username or password"
        return redirect(url_for("locust.login"))

    web_ui.app.register_blueprint(blueprint)


def _switch_login_on(web_ui) -> None:
    """What Locust's web UI does for ``--web-login`` as it is built, done once the final options call for it: Locust
    builds the UI before the locustfile hears of them (the init event), and asks ``web_ui.web_login`` at every
    request."""
    from flask_login import LoginManager

    manager = LoginManager()
    manager.init_app(web_ui.app)
    manager.login_view = "locust.login"
    web_ui.login_manager = manager
    web_ui.web_login = True
