"""Who may use a region: file modes, sharing with a group, and the refusal
to attach another user's region (docs/PROTOCOLS.md §12).

A region file holds other tenants' KV: it is created 0600 (owner only),
or 0660 with `tract init --group NAME` to share it with that group. The
node-local segments a region's processes create in /dev/shm take the
region file's group and mode, so sharing a region shares its locks too.
Attaching a region file that belongs to another user is refused unless it
is shared with one of the caller's groups (root may attach any). A
device-DAX device's access is the device node's, set by the administrator
(udev rules): the kernel enforces it.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat

from tract_cli.core.errors import TractError, UsageError

OWNER_ONLY = 0o600
GROUP_SHARED = 0o660


def group_id(name: str) -> int:
    """The gid of group NAME (a name or a number); a one-line error if unknown."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise UsageError(f"unknown group {name!r}",
                         "give an existing group (see `getent group`)") from None


def apply_sharing(fd: int, gid: int | None) -> None:
    """Sets the mode (0600, or 0660 for a group) and group of a file we created."""
    if gid is not None:
        try:
            os.fchown(fd, -1, gid)
        except PermissionError:
            raise UsageError(f"cannot give the region to group {gid}: you are not in it",
                             "pick one of your groups (`id -Gn`)") from None
    os.fchmod(fd, GROUP_SHARED if gid is not None else OWNER_ONLY)


def sharing_of(path: str) -> tuple[int, int | None]:
    """(mode, gid or None) that files belonging to the region at PATH should get."""
    st = os.stat(path)
    shared = st.st_mode & 0o060 == 0o060     # a file shared with --group, or a device
    return (GROUP_SHARED, st.st_gid) if shared else (OWNER_ONLY, None)  # whose group has rw


def check_may_attach(path: str) -> None:
    """Refuses a region file that belongs to another user and is not shared
    with one of the caller's groups."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return                               # devices: the kernel's permissions rule
    me = os.geteuid()
    if me == 0 or st.st_uid == me:
        return
    if st.st_mode & 0o060 == 0o060 and st.st_gid in {os.getegid(), *os.getgroups()}:
        return
    raise TractError(f"{path} belongs to {_user(st.st_uid)} and is not shared with your groups",
                     f"ask its owner to re-run `tract init` with --group, or to run "
                     f"`chgrp GROUP {path} && chmod g+rw {path}`")


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"
