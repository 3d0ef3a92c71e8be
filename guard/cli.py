"""The ``ghost-guard`` command line. Each command parses its arguments and delegates.

Every option has an environment variable ``GHOST_GUARD_<OPTION>`` (shown in
``--help``); precedence is flag, then environment, then default.
"""

from __future__ import annotations

import click

from guard import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "GHOST_GUARD", "show_default": True})
@click.version_option(__version__, prog_name="ghost-guard")
def main() -> None:
    """kube-ghost-guard: keeps kube-scheduler from looping forever on ghost Pods."""


# --- serve (guard/server.py) -------------------------------------------------


# --- certs (guard/certs.py) --------------------------------------------------


@main.command("certs")
@click.option("--out", default="certs", type=click.Path(file_okay=False), envvar="GHOST_GUARD_OUT", show_envvar=True,
              help="Directory for ca.crt/ca.key, tls.crt/tls.key (serving), client.crt/client.key (kube-scheduler).")
@click.option("--namespace", default="ghost-guard", envvar="GHOST_GUARD_NAMESPACE", show_envvar=True,
              help="Namespace of the guard's Service (SANs <service>.<namespace>.svc[.cluster.local]).")
@click.option("--service", default="ghost-guard", envvar="GHOST_GUARD_SERVICE", show_envvar=True, help="Name of the guard's Service.")
@click.option("--dns", multiple=True, envvar="GHOST_GUARD_DNS", show_envvar=True,
              help="Extra DNS SAN, added to the Service names and localhost (repeatable).")
@click.option("--ip", "ips", multiple=True, envvar="GHOST_GUARD_IP", show_envvar=True,
              help="Extra IP SAN, added to 127.0.0.1 (repeatable).")
@click.option("--days", default=365, type=int, envvar="GHOST_GUARD_DAYS", show_envvar=True,
              help="Lifetime of the serving and client certificates.")
@click.option("--ca-days", default=3650, type=int, envvar="GHOST_GUARD_CA_DAYS", show_envvar=True, help="Lifetime of the CA.")
@click.option("--key-type", default="ecdsa-p256", type=click.Choice(["ecdsa-p256", "rsa-2048", "rsa-3072"]),
              envvar="GHOST_GUARD_KEY_TYPE", show_envvar=True, help="Key algorithm for all three keys.")
@click.option("--force", is_flag=True, envvar="GHOST_GUARD_FORCE", show_envvar=True,
              help="Replace existing files, CA included (every caBundle/caFile must then be updated).")
@click.option("--renew", is_flag=True, envvar="GHOST_GUARD_RENEW", show_envvar=True,
              help="Keep ca.crt/ca.key; reissue the serving and client certificates in place.")
def certs(out: str, namespace: str, service: str, dns: tuple[str, ...], ips: tuple[str, ...], days: int, ca_days: int,
          key_type: str, force: bool, renew: bool) -> None:
    """Write a CA, the guard's serving certificate and kube-scheduler's client certificate.

    Prints the files written and, last, `caBundle: <base64 CA>` for the webhook configuration.
    """
    from guard.certs import CertError, certs_command

    try:
        click.echo(certs_command(out, namespace=namespace, service=service, dns=dns, ips=ips, days=days,
                                 ca_days=ca_days, force=force, renew=renew, key_type=key_type))
    except CertError as e:
        raise click.ClickException(str(e)) from e


# --- audit, report, diagnose (guard/audit.py, guard/attribution.py) ----------


# --- lab, demo (guard/lab/): imported lazily, never on the serving path ------
