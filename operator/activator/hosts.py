"""What a Host header names: a Service DNS name, a bare name or an IP. Pure functions, shared
by the proxy (which passes the name on) and the route table (which decides what it means)."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

Target = tuple[str, str]  # (namespace, name)


def parse_host(host: str, cluster_domain: str = "cluster.local") -> Target | None:
    """(namespace, name) of a Service DNS name in a Host header: <name>.<namespace>,
    <name>.<namespace>.svc or <name>.<namespace>.svc.<cluster_domain>, any port. None for
    anything else, a bare name or an IP included."""
    hostname = host_name(host)
    if not hostname or is_ip(hostname):
        return None
    name, _, rest = hostname.partition(".")
    namespace, _, suffix = rest.partition(".")
    if suffix not in ("", "svc", f"svc.{cluster_domain}"):
        return None
    if not (DNS_LABEL.fullmatch(name) and DNS_LABEL.fullmatch(namespace)):
        return None
    return namespace, name


def host_name(host: str) -> str:
    """The Host header without its port or IPv6 brackets, lowercase, no trailing dot."""
    try:
        return (urllib.parse.urlsplit("//" + host).hostname or "").rstrip(".")
    except ValueError:  # an unbalanced IPv6 bracket
        return ""


def is_ip(hostname: str) -> bool:
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        return False
    return True


def is_bare_name(hostname: str) -> bool:
    return bool(DNS_LABEL.fullmatch(hostname))
