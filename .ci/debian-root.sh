# Sourced by .ci/rabbitmq4 and .ci/postgres17: one Debian root file system per suite (trixie, sid),
# kept outside the clone so later runs reuse it, with packages added on demand. Only Debian
# packages are downloaded. Servers run from it share the host's network (loopback ports of their
# own) and its epmd. Each root has the host's /proc, /sys and /dev bind-mounted into it: delete
# the roots with .ci/clean, which unmounts them first, never with `rm -rf`.

debian_roots="${DEBIAN_ROOTS:-$HOME/.cache/reliable-orders/roots}"
# The Debian mirror apt already uses here (debootstrap needs one spelled out).
debian_mirror="${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)}"
debian_mirror="${debian_mirror:-http://deb.debian.org/debian}"

# Run a command inside `root` with a clean environment.
in_root() { # root command...
    local root=$1
    shift
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        DEBIAN_FRONTEND=noninteractive "$@"
}

# Run a command inside `root` as `user`, with that user's HOME.
in_root_as() { # root user home command...
    local root=$1 user=$2 home=$3
    shift 3
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$home" LANG=C.UTF-8 \
        setpriv --reuid="$user" --regid="$user" --init-groups "$@"
}

root_mounts() { # root
    local target
    for target in proc sys dev; do
        mountpoint -q "$1/$target" || mount --bind "/$target" "$1/$target"
    done
}

# The root of `suite`, made once (debootstrap minbase), with `packages` installed; prints its path.
debian_root() { # suite packages...
    local suite=$1 root="$debian_roots/$1"
    shift
    if [ ! -x "$root/usr/bin/apt-get" ]; then
        command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
        echo "debian-root: debootstrap $suite into $root (about a minute)" >&2
        rm -rf "$root.partial"
        mkdir -p "$debian_roots"
        debootstrap --variant=minbase "$suite" "$root.partial" "$debian_mirror" >/dev/null
        # No daemon starts at install time; the scripts start them with their own settings.
        printf '#!/bin/sh\nexit 101\n' >"$root.partial/usr/sbin/policy-rc.d"
        chmod +x "$root.partial/usr/sbin/policy-rc.d"
        # A mirror's Release files may be past their Valid-Until (snapshots, slow-moving mirrors).
        echo 'Acquire::Check-Valid-Until "false";' >"$root.partial/etc/apt/apt.conf.d/99no-valid-until"
        mv "$root.partial" "$root"
    fi
    # sid's minimal system has no /etc/hosts, and epmd cannot resolve `localhost` without one.
    [ -s "$root/etc/hosts" ] || cp /etc/hosts "$root/etc/hosts"
    root_mounts "$root"
    local missing=() package
    for package in "$@"; do
        in_root "$root" dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' ||
            missing+=("$package")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "debian-root: installing ${missing[*]} into $suite" >&2
        in_root "$root" apt-get update -qq >&2
        in_root "$root" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        in_root "$root" apt-get clean
    fi
    printf '%s\n' "$root"
}
