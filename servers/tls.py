"""TLS for the servers: the command-line options, and the server-side SSL context they make.

The options follow Mosquitto's listener options, by name and meaning:

================================  ===========================  ==========================================
option                            Mosquitto                    meaning
================================  ===========================  ==========================================
``--tls-cert FILE``               ``certfile``                 the server's PEM certificate (chain); TLS on
``--tls-key FILE``                ``keyfile``                  its PEM private key
``--tls-ca-file FILE``            ``cafile``                   CAs trusted for client certificates
``--tls-require-certificate``     ``require_certificate``      a client without a valid certificate is
                                                               refused at the handshake
``--use-identity-as-username``    ``use_identity_as_username`` the certificate's CN is the MQTT username
                                                               (the password file is not used)
``--tls-handshake-timeout S``     (none)                       seconds from accept to a complete handshake
================================  ===========================  ==========================================

As in Mosquitto, without ``--tls-require-certificate`` clients are not asked for a
certificate at all (a server certificate only: encryption, as HTTPS).
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass

import idlekeeper

from .settings import CommandLine, Flag, Path, Setting, seconds

__all__ = ["TLS_GROUP", "TLSOptions", "check_tls_arguments", "tls_options", "tls_settings"]


@dataclass(frozen=True)
class TLSOptions:
    """A server's TLS settings (file paths: each worker makes its own context from them)."""

    cert: str
    """PEM file with the server's certificate, then any intermediates."""
    key: str
    """PEM file with the certificate's private key."""
    ca_file: str | None = None
    """PEM file of the CAs that client certificates must chain to."""
    require_certificate: bool = False
    """Clients must present a certificate that verifies against ``ca_file``."""
    use_identity_as_username: bool = False
    """The client certificate's common name (CN) is the username (MQTT)."""
    handshake_timeout: float = idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT
    """Seconds from accept a client has to complete the TLS handshake."""
    capath: str | None = None
    """A directory of CA certificates (hashed names, ``openssl rehash``), beside ``ca_file``."""
    tls_version: str | None = None
    """The oldest TLS spoken, as Mosquitto names it (``tlsv1.2``, ``tlsv1.3``); None: Python's default."""
    ciphers: str | None = None
    """OpenSSL's cipher list for TLS 1.2 and older (None: Python's default)."""

    def __post_init__(self) -> None:
        if self.require_certificate and not (self.ca_file or self.capath):
            raise ValueError(
                "--tls-require-certificate needs --tls-ca-file (the CAs client certificates must chain to)"
            )
        if self.use_identity_as_username and not self.require_certificate:
            raise ValueError("--use-identity-as-username needs --tls-require-certificate (no certificate, no identity)")
        if not self.handshake_timeout > 0:
            raise ValueError(f"--tls-handshake-timeout must be positive, not {self.handshake_timeout}")

    def context(self) -> ssl.SSLContext:
        """A server-side context: Python's defaults (TLS 1.2 and up, its cipher choice),
        this certificate, and client certificates verified if required."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca_file or self.capath:
            ctx.load_verify_locations(cafile=self.ca_file, capath=self.capath)
        if self.tls_version is not None:
            ctx.minimum_version = _VERSIONS[self.tls_version]
        if self.ciphers is not None:
            ctx.set_ciphers(self.ciphers)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.require_certificate else ssl.CERT_NONE
        return ctx


_VERSIONS = {"tlsv1.1": ssl.TLSVersion.TLSv1_1, "tlsv1.2": ssl.TLSVersion.TLSv1_2, "tlsv1.3": ssl.TLSVersion.TLSv1_3}

TLS_GROUP = "TLS (Mosquitto's listener options)"


def tls_settings(*, client_certificates: bool) -> tuple[Setting, ...]:
    """``--tls-cert``, ``--tls-key`` and ``--tls-handshake-timeout``; with
    ``client_certificates``, also ``--tls-ca-file``, ``--tls-require-certificate`` and
    ``--use-identity-as-username``. A file that does not exist or cannot be read is
    refused naming the option, before anything is bound."""
    group = TLS_GROUP
    common = (
        Setting("--tls-cert", Path(), None, "serve TLS with this PEM certificate (chain)", group=group),
        Setting("--tls-key", Path(), None, "the certificate's PEM private key (with --tls-cert)", group=group),
        Setting(
            "--tls-handshake-timeout",
            seconds(),
            idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT,
            "seconds from accept to a complete TLS handshake; a client that stalls mid-handshake "
            f"is cut then (default: {idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT:g})",
            group=group,
        ),
    )
    if not client_certificates:
        return common
    return (
        *common,
        Setting("--tls-ca-file", Path(), None, "PEM file of CAs trusted for client certificates", group=group),
        Setting(
            "--tls-require-certificate",
            Flag(),
            False,
            "refuse, at the handshake, a client without a certificate signed by --tls-ca-file "
            "(Mosquitto's require_certificate)",
            group=group,
        ),
        Setting(
            "--use-identity-as-username",
            Flag(),
            False,
            "the client certificate's CN is the username for ACLs and presence; the password file is "
            "not used (Mosquitto's use_identity_as_username; needs --tls-require-certificate)",
            group=group,
        ),
    )


def tls_options(args: argparse.Namespace) -> TLSOptions | None:
    """The TLS settings of a command line parsed with :func:`tls_settings`; None
    without ``--tls-cert``. Raises ValueError for a combination that cannot work."""
    cert = getattr(args, "tls_cert", None)
    key = getattr(args, "tls_key", None)
    if cert is None:
        if key is not None or getattr(args, "tls_require_certificate", False):
            raise ValueError("the TLS options need --tls-cert")
        return None
    if key is None:
        raise ValueError("--tls-cert needs --tls-key")
    return TLSOptions(
        cert=cert,
        key=key,
        ca_file=getattr(args, "tls_ca_file", None),
        require_certificate=getattr(args, "tls_require_certificate", False),
        use_identity_as_username=getattr(args, "use_identity_as_username", False),
        handshake_timeout=args.tls_handshake_timeout,
    )


def check_tls_arguments(parser: CommandLine, args: argparse.Namespace) -> None:
    """Refuse, in one line, TLS options that cannot work: a bad combination, or files
    that do not load as a certificate and its key."""
    try:
        options = tls_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    if options is None:
        return
    try:
        options.context()
    except ssl.SSLError as exc:
        files = f"--tls-cert {options.cert} and --tls-key {options.key}"
        if options.ca_file:
            files += f" (or --tls-ca-file {options.ca_file})"
        parser.error(f"{files} do not load as a PEM certificate and its key ({exc.reason or exc})")
    except OSError as exc:
        parser.error(f"the TLS files do not load: {exc.strerror or exc} ({exc.filename})")
