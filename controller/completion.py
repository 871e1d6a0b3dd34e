"""Shell completion for agentctl: bash and zsh scripts generated from its argparse tree.

The tree becomes three lookup functions (what may follow a command path: subcommands and
options; the choices of its N-th positional argument; the values of an option) and one
shell-neutral function that walks the typed words through them. bash calls it from a
`complete -F` function, zsh from a `compdef` one, so both complete the same words.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["SHELLS", "completion_script"]

SHELLS = ("bash", "zsh")

# every word the script embeds is one of these, so none needs quoting inside "..."
_SAFE_WORD = re.compile(r"[A-Za-z0-9_.,:=+-]+")


@dataclass
class _Node:
    """What may follow one command path."""

    commands: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    value_options: list[str] = field(default_factory=list)  # options that take a value
    positionals: list[list[str]] = field(default_factory=list)  # choices per positional
    option_values: dict[str, list[str]] = field(default_factory=dict)


def _nodes(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, _Node]]:
    node = _Node()
    children: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                node.commands.append(name)
                children.append((f"{path} {name}".strip(), sub))
        elif action.option_strings:
            node.options.extend(action.option_strings)
            if action.nargs != 0:
                node.value_options.extend(action.option_strings)
                if action.choices is not None:
                    for opt in action.option_strings:
                        node.option_values[opt] = [str(c) for c in action.choices]
        else:
            node.positionals.append([str(c) for c in action.choices or ()])
    yield path, node
    for child_path, child in children:
        yield from _nodes(child, child_path)


def _words(words: list[str]) -> str:
    for w in words:
        if not _SAFE_WORD.fullmatch(w):
            raise ValueError(f"cannot embed {w!r} in a completion script")
    return " ".join(words)


def _functions(prog: str, parser: argparse.ArgumentParser) -> str:
    fn = "_" + re.sub(r"\W", "_", prog)
    spec, positional, values = [], [], []
    for path, node in _nodes(parser):
        spec.append(
            f'        "{path}") _cmds="{_words(node.commands)}"; _opts="{_words(node.options)}"; '
            f'_vopts="{_words(node.value_options)}" ;;'
        )
        for i, choices in enumerate(node.positionals):
            if choices:
                positional.append(f'        "{path}:{i}") echo "{_words(choices)}" ;;')
        for opt, choices in node.option_values.items():
            values.append(f'        "{path}:{opt}") echo "{_words(choices)}" ;;')
    return f"""\
# what may follow a command path: subcommands, options, options taking a value
{fn}_spec() {{
    case "$1" in
{chr(10).join(spec)}
        *) _cmds=""; _opts=""; _vopts="" ;;
    esac
}}

# the choices of positional argument $2 (counting from 0) after command path $1
{fn}_positional() {{
    case "$1:$2" in
{chr(10).join(positional)}
    esac
}}

# the values option $2 takes after command path $1
{fn}_values() {{
    case "$1:$2" in
{chr(10).join(values)}
    esac
}}

# {fn}_candidates CWORD WORD...: the words that may stand at index CWORD (0 = the program)
{fn}_candidates() {{
    local cword="$1" i=0 path="" npos=0 value_of="" cur="" word _cmds _opts _vopts
    shift
    {fn}_spec ""
    for word in "$@"; do
        if [ "$i" -eq "$cword" ]; then
            cur="$word"
            break
        fi
        if [ "$i" -gt 0 ]; then
            if [ -n "$value_of" ]; then
                value_of=""
            else
                case "$word" in
                    --*=*) ;;
                    -*) case " $_vopts " in *" $word "*) value_of="$word" ;; esac ;;
                    *)
                        case " $_cmds " in
                            *" $word "*)
                                path="${{path:+$path }}$word"
                                npos=0
                                {fn}_spec "$path"
                                ;;
                            *) npos=$((npos + 1)) ;;
                        esac
                        ;;
                esac
            fi
        fi
        i=$((i + 1))
    done
    if [ -n "$value_of" ]; then
        {fn}_values "$path" "$value_of"
    else
        case "$cur" in
            -*) echo "$_opts" ;;
            *) echo "$_cmds $({fn}_positional "$path" "$npos")" ;;
        esac
    fi
}}
"""


def completion_script(
    parser: argparse.ArgumentParser, *, shell: str, prog: str | None = None
) -> str:
    """The completion script for `shell` ("bash" or "zsh") of `parser`'s program."""
    prog = prog or parser.prog
    fn = "_" + re.sub(r"\W", "_", prog)
    body = _functions(prog, parser)
    if shell == "bash":
        return f"""\
# bash completion for {prog}; load it with: source <({prog} completion bash)
{body}
{fn}() {{
    local IFS=$' \\t\\n'
    COMPREPLY=($(compgen -W "$({fn}_candidates "$COMP_CWORD" "${{COMP_WORDS[@]}}")" \\
        -- "${{COMP_WORDS[COMP_CWORD]}}"))
}}
# nothing to offer (a node name, a file): bash's default completion (file names)
complete -o default -F {fn} {prog}
"""
    if shell == "zsh":
        return f"""\
# zsh completion for {prog}; load it after compinit with: source <({prog} completion zsh)
{body}
{fn}_zsh() {{
    local -a candidates
    candidates=(${{=$({fn}_candidates $((CURRENT - 1)) "${{words[@]}}")}})
    if (( ${{#candidates}} )); then
        compadd -- "${{candidates[@]}}"
    else
        _default
    fi
}}
compdef {fn}_zsh {prog}
"""
    raise ValueError(f"unknown shell {shell!r} (one of {', '.join(SHELLS)})")
