"""Shell completion scripts for `qm`, generated from its own argument parser.

`qm completion bash` and `qm completion zsh` print a static script: the
subcommands, each one's options, the choices of options that have them, and
after `--` the shell's own completion of the job's command. The script is
written here rather than taken from argcomplete because argcomplete would be a
new dependency and runs `qm` itself (a Python start) on every Tab; a static
script answers at once and still follows the parser, since it is generated
from it whenever it is printed.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

SHELLS = ("bash", "zsh")


@dataclass(frozen=True)
class Option:
    """One option of a subcommand as the completion scripts need it."""

    flags: tuple[str, ...]
    help: str
    takes_value: bool
    choices: tuple[str, ...]


@dataclass(frozen=True)
class Command:
    """One subcommand: its options, the choices of its positional arguments,
    and whether it ends with a command line of its own (`qm submit ... -- cmd`)."""

    name: str
    help: str
    options: tuple[Option, ...]
    positional_choices: tuple[str, ...]
    takes_command: bool


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[Command]:
    # argparse has no public way to list subparsers; its `_SubParsersAction` is the
    # documented type behind `add_subparsers()` and keeps them in `choices`.
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, subparser in action.choices.items():
            options: list[Option] = []
            positional_choices: list[str] = []
            takes_command = False
            for sub_action in subparser._actions:
                choices = tuple(str(c) for c in sub_action.choices or ())
                if sub_action.option_strings:
                    options.append(
                        Option(
                            flags=tuple(sub_action.option_strings),
                            help=sub_action.help or "",
                            takes_value=sub_action.nargs != 0,
                            choices=choices,
                        )
                    )
                elif sub_action.nargs == argparse.REMAINDER:
                    takes_command = True
                else:
                    positional_choices.extend(choices)
            yield Command(
                name=name,
                help=helps.get(name, ""),
                options=tuple(options),
                positional_choices=tuple(positional_choices),
                takes_command=takes_command,
            )


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for `shell` (one of SHELLS)."""
    commands = list(_subcommands(parser))
    if shell == "bash":
        return _bash(parser.prog, commands)
    if shell == "zsh":
        return _zsh(parser.prog, commands)
    raise ValueError(f"no completion for {shell!r}; one of {', '.join(SHELLS)}")


# --- bash ----------------------------------------------------------------------


def _bash(prog: str, commands: list[Command]) -> str:
    function = f"_{prog}_complete"
    branches = []
    for command in commands:
        words = [flag for option in command.options for flag in option.flags]
        words += command.positional_choices
        value_cases = []
        for option in command.options:
            if not option.takes_value:
                continue
            # A value the user types (a team, a job id) has no list to offer.
            reply = f'COMPREPLY=($(compgen -W "{" ".join(option.choices)}" -- "$cur"))'
            value_cases.append(
                f"                {'|'.join(option.flags)}) "
                f"{reply if option.choices else 'COMPREPLY=()'}; return ;;"
            )
        after_command = (
            [
                "            for (( i = 2; i < COMP_CWORD; i++ )); do",
                "                if [[ ${COMP_WORDS[i]} == -- ]]; then",
                "                    # The job's own command line: complete as the shell would.",
                "                    compopt -o bashdefault -o default 2>/dev/null",
                "                    COMPREPLY=()",
                "                    return",
                "                fi",
                "            done",
            ]
            if command.takes_command
            else []
        )
        branches.append(
            "\n".join(
                [
                    f"        {command.name})",
                    *after_command,
                    *(
                        ['            case "$prev" in', *value_cases, "            esac"]
                        if value_cases
                        else []
                    ),
                    f'            COMPREPLY=($(compgen -W "{" ".join(words)}" -- "$cur"))',
                    "            ;;",
                ]
            )
        )
    names = " ".join(command.name for command in commands)
    return "\n".join(
        [
            f"# bash completion for {prog}; generated by `{prog} completion bash`.",
            f'# Load it with: eval "$({prog} completion bash)"',
            f"{function}() {{",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" i',
            "    if (( COMP_CWORD == 1 )); then",
            f'        COMPREPLY=($(compgen -W "{names} -h --help" -- "$cur"))',
            "        return",
            "    fi",
            '    case "${COMP_WORDS[1]}" in',
            *branches,
            "        *) COMPREPLY=() ;;",
            "    esac",
            "}",
            f"complete -F {function} {prog}",
            "",
        ]
    )


# --- zsh -----------------------------------------------------------------------


def _zsh_text(text: str) -> str:
    """Help text made safe inside a single-quoted `_arguments` spec: a bracket
    would end the explanation, and a quote the word."""
    text = text.replace("[", "(").replace("]", ")")
    return text.replace("'", "'\\''")


def _zsh_option(option: Option) -> list[str]:
    specs = []
    for flag in option.flags:
        spec = f"{flag}[{_zsh_text(option.help or flag)}]"
        if option.takes_value:
            name = flag.lstrip("-").replace("-", " ")
            spec += f":{name}:" + (f"({' '.join(option.choices)})" if option.choices else " ")
        specs.append(f"'{spec}'")
    return specs


def _zsh(prog: str, commands: list[Command]) -> str:
    described = [f"        '{command.name}:{_zsh_text(command.help)}'" for command in commands]
    branches = []
    for command in commands:
        specs = [spec for option in command.options for spec in _zsh_option(option)]
        if command.positional_choices:
            specs.append(f"':argument:({' '.join(command.positional_choices)})'")
        if command.takes_command:
            specs.append("'*::command:_normal'")
        arguments = " \\\n                ".join(["_arguments", *specs])
        branches.append(f"        ({command.name})\n            {arguments}\n            ;;")
    return "\n".join(
        [
            f"#compdef {prog}",
            f"# zsh completion for {prog}; generated by `{prog} completion zsh`.",
            f"# Load it with: source <({prog} completion zsh)   (after compinit)",
            f"_{prog}() {{",
            "    local -a commands",
            "    commands=(",
            *described,
            "    )",
            "    if (( CURRENT == 2 )); then",
            f"        _describe -t commands '{prog} command' commands",
            "        return",
            "    fi",
            "    local command=$words[2]",
            "    shift words",
            "    (( CURRENT-- ))",
            "    case $command in",
            *branches,
            "    esac",
            "}",
            'if [[ "${zsh_eval_context[-1]}" == loadautofunc ]]; then',
            f'    _{prog} "$@"',
            "else",
            f"    compdef _{prog} {prog}",
            "fi",
            "",
        ]
    )
