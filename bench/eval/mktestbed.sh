#!/usr/bin/env bash
# Builds the /testbed layer of one SWE task's sandbox for `crab-bench eval`:
# the project's source distribution from PyPI at RELEASE (its sha256 checked
# against PyPI's simple index), unpacked into /testbed and committed to a fresh
# git repository (fixed author and date, so every build is the same), its
# runtime dependencies (pure-Python wheels, also checked) unpacked into
# /opt/deps, and /opt/bin/python naming the host's /usr/bin/python3.
# usage: mktestbed.sh LAYER_DIR PROJECT RELEASE [DEP==VERSION...]
set -euo pipefail
shopt -s inherit_errexit
out=$1 project=$2 release=$3
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# fetch NAME VERSION KIND: downloads NAME's file of that kind at VERSION
# (sdist: the .tar.gz; wheel: a pure py3 one) from PyPI's simple index,
# checks the sha256 the index gives, prints its path.
fetch() {
  curl -fsSL --retry 3 "https://pypi.org/simple/$1/" -o "$work/index.html"
  /usr/bin/python3 - "$work/index.html" "$1" "$2" "$3" >"$work/pick" <<'PY'
import html.parser, re, sys
index, name, version, kind = sys.argv[1:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
class Links(html.parser.HTMLParser):
    href, found = None, []
    def handle_starttag(self, tag, attrs):
        self.href = dict(attrs).get("href") if tag == "a" else None
    def handle_data(self, data):
        if self.href:
            self.found.append((data.strip(), self.href))
links = Links()
links.feed(open(index).read())
for filename, href in links.found:
    url, _, digest = href.partition("#sha256=")
    base = norm(filename)
    if kind == "sdist":
        ok = base == norm(f"{name}-{version}") + "_tar_gz"
    else:
        ok = base.startswith(norm(f"{name}-{version}") + "_") and filename.endswith("-none-any.whl")
    if ok and digest:
        print(url, digest, filename)
        break
else:
    sys.exit(f"no {kind} of {name} {version} on PyPI")
PY
  read -r url sha name <"$work/pick"
  curl -fsSL --retry 3 "$url" -o "$work/$name"
  echo "$sha  $work/$name" | sha256sum -c --quiet - >&2
  echo "$work/$name"
}
rm -rf "$out"
mkdir -p "$out/testbed" "$out/opt/deps" "$out/opt/bin"
sdist=$(fetch "$project" "$release" sdist)
tar -xzf "$sdist" -C "$out/testbed" --strip-components=1 --no-same-owner
for dep in "$@"; do
  wheel=$(fetch "${dep%%==*}" "${dep##*==}" bdist_wheel)
  /usr/bin/python3 -m zipfile -e "$wheel" "$out/opt/deps"
done
ln -s /usr/bin/python3 "$out/opt/bin/python"
export GIT_AUTHOR_NAME=crab GIT_AUTHOR_EMAIL=crab@localhost GIT_COMMITTER_NAME=crab \
  GIT_COMMITTER_EMAIL=crab@localhost GIT_AUTHOR_DATE="315532800 +0000" GIT_COMMITTER_DATE="315532800 +0000"
git -C "$out/testbed" init -q
# What the project's own repository ignores (an sdist ships no
# .gitignore): bytecode, whose content holds its source's mtime.
printf '__pycache__/\n*.py[cod]\n*.egg-info/\n' >>"$out/testbed/.git/info/exclude"
git -C "$out/testbed" -c gc.auto=0 add -A
git -C "$out/testbed" -c gc.auto=0 commit -q -m "$project $release from PyPI"
git -C "$out/testbed" gc -q
