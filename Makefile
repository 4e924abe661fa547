# meshkit: `make demo` runs the main job on the local lab, `make test` runs the tests.
# Both set themselves up on a fresh Debian/Ubuntu machine (run as root).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# molecule and ansible-lint find ansible's tools through PATH.
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Ansible's own state (tmp, installed collections) stays in the checkout: a copy of this collection
# installed in ~/.ansible by some other run must never shadow the code being tested.
export ANSIBLE_HOME := $(CURDIR)/.cache/ansible-home

.PHONY: all demo demo-down test lint unit integration deps venv clean

all: test

deps:
	@bash scripts/system-deps

$(VENV)/.installed: requirements.txt requirements-dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	@touch $@

venv: deps $(VENV)/.installed

## The main job on the local lab: a 4-host mesh reached over SSH, its network converged.
demo: venv
	time ansible-playbook playbooks/lab.yml
	ansible -i inventory/lab.yml all -m ansible.builtin.ping
	time ansible-playbook -i inventory/lab.yml setup.yml
	@echo "The lab stays up: ssh via 'ansible -i inventory/lab.yml ...'; remove it with 'make demo-down'."

demo-down: venv
	ansible-playbook playbooks/lab.yml -e lab_state=absent

lint: venv
	ruff check .
	ruff format --check .
	ansible-lint

unit: venv
	pytest tests/unit

integration: venv
	pytest tests/integration

## Lint, then every test (unit and lab integration) in one pytest run.
test: lint
	pytest tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
