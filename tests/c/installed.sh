#!/usr/bin/env bash
# The C ABI as a user gets it: scripts/install-capi.sh into a fresh prefix, then tests/c/smoke.c
# and tests/cpp/smoke.cpp built against that prefix only, once through pkg-config (the shared
# library, and the C program with `--static` against the static one) and once through CMake
# (find_package(emuhost 0.MINOR), emuhost::emuhost and emuhost::emuhost_static), and run. Checks
# that the programs need the SONAME (not libemuhost_capi.so), that CMake refuses a version the
# package does not serve, and that a C file ignoring an error does not compile under
# -Werror=unused-result with the installed header. Run by .ci/run; needs cc, c++, pkg-config,
# cmake (and for the Vulkan part libvulkan-dev, else it is left out, saying so).
# Usage: tests/c/installed.sh [install-capi.sh arguments but --prefix, e.g. --profile dev]
set -euo pipefail
cd "$(dirname "$0")/../.."

say() { echo "capi-installed: $*"; }
fail() {
    echo "capi-installed: FAILED: $*" >&2
    exit 1
}

work=$(mktemp -d "${TMPDIR:-/tmp}/emuhost-capi-installed.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
bash scripts/install-capi.sh --prefix "$prefix" "$@"
libdir=$prefix/lib
version=$(sed -n 's/^#define EMUHOST_VERSION_STRING "\(.*\)"$/\1/p' include/emuhost.h)
IFS=. read -r major minor _ <<<"$version"
if [ "$major" = 0 ]; then soname=libemuhost_capi.so.0.$minor; else soname=libemuhost_capi.so.$major; fi

export PKG_CONFIG_PATH=$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
# The programs' Vulkan part where the Vulkan development files are.
if pkg-config --exists vulkan; then
    vulkan=1
else
    vulkan=0
    say "no Vulkan development files (apt-get install libvulkan-dev): the programs' Vulkan part is left out"
fi

# Runs one program; it must say it is ok and that the library serves its header.
check_run() {
    local exe=$1 out
    out=$("$exe" 2>&1) || fail "$exe (exit $?):"$'\n'"$out"
    grep -q "^smoke: ok" <<<"$out" || fail "$exe: no \"smoke: ok\":"$'\n'"$out"
    grep -qF "version: header $version, library $version: compatible" <<<"$out" || fail "$exe: no version line:"$'\n'"$out"
    say "$(basename "$exe") ran: $(grep '^smoke: ok' <<<"$out")"
}
# The program loads the library by its SONAME.
check_needed() {
    readelf -d -W "$1" | grep -F "(NEEDED)" | grep -qF "[$soname]" \
        || fail "$1 does not need $soname:"$'\n'"$(readelf -d -W "$1" | grep NEEDED)"
}

# --- pkg-config -------------------------------------------------------------------------------
pc=$work/pkg-config
mkdir -p "$pc"
[ "$(pkg-config --modversion emuhost)" = "$version" ] || fail "pkg-config --modversion emuhost: $(pkg-config --modversion emuhost)"
vk_c=() vk_flags=(-DSMOKE_NO_VULKAN)
if [ $vulkan = 1 ]; then
    read -ra vk_cflags <<<"$(pkg-config --cflags vulkan)"
    read -ra vk_libs <<<"$(pkg-config --libs vulkan)"
    cc -std=c11 -Wall -Wextra -Werror "${vk_cflags[@]}" -c tests/c/vkdev.c -o "$pc/vkdev.o"
    vk_c=("$pc/vkdev.o" "${vk_libs[@]}") vk_flags=()
fi
flags=(-Wall -Wextra -Werror -pedantic -D_GNU_SOURCE -Itests/c "${vk_flags[@]}")
rpath=-Wl,-rpath,$(pkg-config --variable=libdir emuhost)
# shellcheck disable=SC2046 # pkg-config's flags are words.
cc -std=c11 "${flags[@]}" $(pkg-config --cflags emuhost) tests/c/smoke.c "${vk_c[@]}" \
    $(pkg-config --libs emuhost) "$rpath" -lpthread -o "$pc/smoke-c"
# shellcheck disable=SC2046
c++ -std=c++17 "${flags[@]}" $(pkg-config --cflags emuhost) tests/cpp/smoke.cpp "${vk_c[@]}" \
    $(pkg-config --libs emuhost) "$rpath" -lpthread -o "$pc/smoke-cpp"
# --static: Libs.private too; -l: would take the shared library, so the archive by its path.
# shellcheck disable=SC2046
cc -std=c11 "${flags[@]}" $(pkg-config --cflags emuhost) tests/c/smoke.c "${vk_c[@]}" \
    "$libdir/libemuhost_capi.a" $(pkg-config --static --libs-only-l emuhost | sed 's/-lemuhost_capi//') -o "$pc/smoke-c-static"
check_needed "$pc/smoke-c"
check_needed "$pc/smoke-cpp"
! readelf -d -W "$pc/smoke-c-static" | grep -q "libemuhost_capi" || fail "smoke-c-static needs the shared library"
for exe in smoke-c smoke-cpp smoke-c-static; do check_run "$pc/$exe"; done

# An ignored error does not compile under -Werror=unused-result with the installed header.
# shellcheck disable=SC2046
if cc -std=c11 $(pkg-config --cflags emuhost) -Werror=unused-result -c tests/c/ignored_error.c -o "$pc/ignored.o" 2>"$pc/ignored.txt"; then
    fail "tests/c/ignored_error.c compiled under -Werror=unused-result"
fi
grep -q "emuhost_space_reserve" "$pc/ignored.txt" || fail "the refusal does not name the call: $(cat "$pc/ignored.txt")"
say "an ignored error does not compile under -Werror=unused-result"

# --- CMake ------------------------------------------------------------------------------------
build=$work/cmake
smoke_vulkan=OFF
[ $vulkan = 0 ] || smoke_vulkan=ON
if ! cmake -S tests/c/cmake -B "$build" -DCMAKE_PREFIX_PATH="$prefix" -DEMUHOST_WANT="$major.$minor" \
    -DSMOKE_VULKAN=$smoke_vulkan >"$work/cmake.log" 2>&1; then
    cat "$work/cmake.log" >&2
    fail "cmake could not configure tests/c/cmake against $prefix"
fi
cmake --build "$build" -j 2 >"$work/cmake-build.log" 2>&1 || { cat "$work/cmake-build.log" >&2; fail "cmake --build"; }
check_needed "$build/smoke-c"
check_needed "$build/smoke-cpp"
for exe in smoke-c smoke-cpp smoke-c-static; do check_run "$build/$exe"; done
# A version the package does not serve: the next major (and before 1.0 the next minor).
if [ "$major" = 0 ]; then refused=0.$((minor + 1)); else refused=$((major + 1)).0; fi
if cmake -S tests/c/cmake -B "$work/cmake-refused" -DCMAKE_PREFIX_PATH="$prefix" -DEMUHOST_WANT="$refused" \
    -DSMOKE_VULKAN=OFF >"$work/cmake-refused.log" 2>&1; then
    fail "find_package(emuhost $refused) took emuhost $version"
fi
grep -q "$version" "$work/cmake-refused.log" || fail "find_package(emuhost $refused) refused without naming $version: $(cat "$work/cmake-refused.log")"
say "find_package(emuhost $refused) refuses $version"
say "ok: the C and C++ programs built through pkg-config and CMake against $prefix, and ran"
