from asyncrl.cli import entry

entry()
