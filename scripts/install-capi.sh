#!/usr/bin/env bash
# Installs emuhost's C ABI into a prefix (Linux), as a C or C++ program's build finds it:
#
#   PREFIX/include/emuhost.h, emuhost.hpp        the header (cbindgen) and the C++17 wrapper
#   LIBDIR/libemuhost_capi.so.VERSION            the shared library, whose SONAME
#   LIBDIR/libemuhost_capi.so.ABI -> .so.VERSION   (ABI: MAJOR, or 0.MINOR before 1.0) is this link
#   LIBDIR/libemuhost_capi.so -> .so.ABI         the name the linker takes for -lemuhost_capi
#   LIBDIR/libemuhost_capi.a                     the static library
#   LIBDIR/pkgconfig/emuhost.pc                  pkg-config --cflags --libs emuhost (--static too)
#   LIBDIR/cmake/emuhost/emuhostConfig.cmake     find_package(emuhost 0.1 REQUIRED): the imported
#   LIBDIR/cmake/emuhost/emuhostConfigVersion.cmake  targets emuhost::emuhost (shared) and
#                                                emuhost::emuhost_static
#
# Usage: scripts/install-capi.sh --prefix DIR [--libdir DIR] [--profile release|dev|NAME] [--no-build]
#   --prefix DIR    where to install (required; made if missing)
#   --libdir DIR    the libraries' folder (default PREFIX/lib)
#   --profile NAME  cargo's profile to build and install (default release)
#   --no-build      install what `cargo build -p emuhost-capi --profile NAME` made already
# Exit 0 installed, 2 an error (a bad argument, a failed build, a library without its SONAME).
# CARGO_TARGET_DIR is honoured. Windows: see docs/capi.md#windows (no install step there).
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
    echo "install-capi: $*" >&2
    exit 2
}
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

prefix='' libdir='' profile=release build=1
while [ $# -gt 0 ]; do
    case $1 in
        --prefix | --libdir | --profile)
            [ $# -ge 2 ] || die "$1 needs a value"
            case $1 in --prefix) prefix=$2 ;; --libdir) libdir=$2 ;; --profile) profile=$2 ;; esac
            shift 2
            ;;
        --prefix=*) prefix=${1#*=}; shift ;;
        --libdir=*) libdir=${1#*=}; shift ;;
        --profile=*) profile=${1#*=}; shift ;;
        --no-build) build=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument \"$1\" (see --help)" ;;
    esac
done
[ -n "$prefix" ] || die "--prefix DIR is required (see --help)"
[ "$(uname -s)" = Linux ] || die "this script installs for Linux; for Windows see docs/capi.md#windows"
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
libdir=${libdir:-$prefix/lib}
mkdir -p "$libdir"
libdir=$(cd "$libdir" && pwd)

# The version is the header's (the test header::header_is_current keeps it the crate's).
version=$(sed -n 's/^#define EMUHOST_VERSION_STRING "\(.*\)"$/\1/p' include/emuhost.h)
IFS=. read -r major minor _ <<<"$version"
if [ -z "$version" ] || [ -z "$minor" ]; then die "include/emuhost.h has no EMUHOST_VERSION_STRING"; fi
if [ "$major" = 0 ]; then abi=0.$minor; else abi=$major; fi
soname=libemuhost_capi.so.$abi

if [ "$build" = 1 ]; then
    cargo build -p emuhost-capi --profile "$profile" || die "cargo build -p emuhost-capi --profile $profile failed"
fi
case $profile in dev | test) out=debug ;; release | bench) out=release ;; *) out=$profile ;; esac
built=${CARGO_TARGET_DIR:-target}/$out
for f in libemuhost_capi.so libemuhost_capi.a; do
    [ -f "$built/$f" ] || die "no $built/$f (cargo build -p emuhost-capi --profile $profile)"
done
# The SONAME that build.rs sets: a library without it would be found by no program's loader.
got=$(readelf -d -W "$built/libemuhost_capi.so" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
[ "$got" = "$soname" ] || die "$built/libemuhost_capi.so has the SONAME \"$got\", not $soname"

install -d "$prefix/include" "$libdir/pkgconfig" "$libdir/cmake/emuhost"
install -m 644 include/emuhost.h include/emuhost.hpp "$prefix/include/"
install -m 755 "$built/libemuhost_capi.so" "$libdir/libemuhost_capi.so.$version"
ln -sfn "libemuhost_capi.so.$version" "$libdir/$soname"
ln -sfn "$soname" "$libdir/libemuhost_capi.so"
install -m 644 "$built/libemuhost_capi.a" "$libdir/libemuhost_capi.a"

# What the Rust standard library in the static library needs from the system
# (`rustc --print native-static-libs`); the shared library links them itself.
private=(gcc_s util rt pthread m dl c)

cat >"$libdir/pkgconfig/emuhost.pc" <<PC
prefix=$prefix
includedir=\${prefix}/include
libdir=$libdir

Name: emuhost
Description: emuhost's C ABI: the host layer for console emulators (emuhost.h; C++17: emuhost.hpp)
Version: $version
Cflags: -I\${includedir}
Libs: -L\${libdir} -lemuhost_capi
Libs.private: ${private[*]/#/-l}
PC

# Paths relative to the package's folder, so the prefix may move.
rel_prefix=$(realpath -m --relative-to="$libdir/cmake/emuhost" "$prefix")
rel_libdir=$(realpath -m --relative-to="$libdir/cmake/emuhost" "$libdir")
cat >"$libdir/cmake/emuhost/emuhostConfig.cmake" <<CMAKE
# emuhost's C ABI, installed by scripts/install-capi.sh: find_package(emuhost REQUIRED), then
# target_link_libraries(app PRIVATE emuhost::emuhost) (the shared library) or
# emuhost::emuhost_static. Both carry the include folder (emuhost.h; emuhost.hpp needs C++17).
get_filename_component(_emuhost_prefix "\${CMAKE_CURRENT_LIST_DIR}/$rel_prefix" ABSOLUTE)
get_filename_component(_emuhost_libdir "\${CMAKE_CURRENT_LIST_DIR}/$rel_libdir" ABSOLUTE)
if(NOT TARGET emuhost::emuhost)
  add_library(emuhost::emuhost SHARED IMPORTED)
  set_target_properties(emuhost::emuhost PROPERTIES
    IMPORTED_LOCATION "\${_emuhost_libdir}/libemuhost_capi.so.$version"
    IMPORTED_SONAME "$soname"
    INTERFACE_INCLUDE_DIRECTORIES "\${_emuhost_prefix}/include")
endif()
if(NOT TARGET emuhost::emuhost_static)
  add_library(emuhost::emuhost_static STATIC IMPORTED)
  set_target_properties(emuhost::emuhost_static PROPERTIES
    IMPORTED_LOCATION "\${_emuhost_libdir}/libemuhost_capi.a"
    INTERFACE_INCLUDE_DIRECTORIES "\${_emuhost_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$(IFS=";"; echo "${private[*]}")")
endif()
set(emuhost_VERSION "$version")
unset(_emuhost_prefix)
unset(_emuhost_libdir)
CMAKE

cat >"$libdir/cmake/emuhost/emuhostConfigVersion.cmake" <<CMAKE
# The rule of emuhost_version_compatible: the same major and at least the minor asked for; before
# 1.0 the same minor (every 0.x minor may change the ABI). 64-bit only.
set(PACKAGE_VERSION "$version")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
if("\${PACKAGE_FIND_VERSION}" STREQUAL "")
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(PACKAGE_FIND_VERSION_MAJOR EQUAL $major AND NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  if(NOT $major EQUAL 0 OR PACKAGE_FIND_VERSION_MINOR EQUAL $minor)
    set(PACKAGE_VERSION_COMPATIBLE TRUE)
  endif()
endif()
if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
  set(PACKAGE_VERSION_EXACT TRUE)
endif()
if(NOT CMAKE_SIZEOF_VOID_P STREQUAL "8")
  set(PACKAGE_VERSION "\${PACKAGE_VERSION} (64-bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
CMAKE

echo "install-capi: emuhost $version ($soname) installed into $prefix (libraries in $libdir)"
