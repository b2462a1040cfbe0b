# wmrl: build, test, benchmark.
GO       ?= go
BENCH    ?= .
COUNT    ?= 6
PKGS     ?= ./...

.PHONY: all build test bench lint

all: lint test

build:
	$(GO) build -o bin/wmrl ./cmd/wmrl

# The whole suite with the race detector; CI runs exactly this.
test:
	$(GO) test -race -count=1 $(PKGS)

# Benchmarks, each run $(COUNT) times; benchstat prints the medians (with
# their spread) of every figure, including the project's own units such as
# x_sklearn and µs/pair. Raw results stay in bench.out.
bench:
	$(GO) test -run '^$$' -bench '$(BENCH)' -count $(COUNT) $(PKGS) | tee bench.out
	$(GO) tool benchstat bench.out

lint:
	$(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
