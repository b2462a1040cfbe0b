// Reads an archive with DuckDB (@duckdb/node-api), an independent Parquet
// reader, and prints aggregates the Go test compares with its own reader.
// Usage: NODE_PATH=<dir with node_modules> node duckdb_read.cjs '<glob>'
// union_by_name: an archive's older files may lack a column added since
// (exec_detail, prompt); without it DuckDB takes the first file's columns
// for all.
const { DuckDBInstance } = require('@duckdb/node-api');

(async () => {
  const db = await DuckDBInstance.create(':memory:');
  const c = await db.connect();
  const glob = process.argv[2].replaceAll("'", "''");
  const r = await c.runAndReadAll(`
    SELECT count(*)::BIGINT AS rows,
           count(DISTINCT step)::BIGINT AS steps,
           count(predicted)::BIGINT AS predicted,
           count(true_score)::BIGINT AS true_scores,
           count(exec_status)::BIGINT AS exec_statuses,
           count(exec_detail)::BIGINT AS exec_details,
           count(exec_copy_of)::BIGINT AS exec_copies,
           count(exec_copy_group)::BIGINT AS exec_copy_groups,
           coalesce(sum(exec_copy_step), 0)::BIGINT AS exec_copy_steps,
           count(wm_verdict)::BIGINT AS wm_verdicts,
           count(wm_rationale)::BIGINT AS wm_rationales,
           count(wm_model)::BIGINT AS wm_models,
           coalesce(string_agg(DISTINCT wm_model, ',' ORDER BY wm_model), '') AS wm_model_names,
           count(prompt)::BIGINT AS prompts,
           count(response)::BIGINT AS responses,
           coalesce(sum(length(response)), 0)::BIGINT AS response_chars,
           coalesce(sum(response_bytes), 0)::BIGINT AS response_bytes,
           sum(CASE WHEN is_anchor THEN 1 ELSE 0 END)::BIGINT AS anchors,
           sum(CASE WHEN source = 'late_anchor' THEN 1 ELSE 0 END)::BIGINT AS late,
           round(sum(fused_advantage * step), 6)::DOUBLE AS fused_by_step,
           round(sum(coalesce(calibrated, 0)), 6)::DOUBLE AS calibrated,
           min(ts)::VARCHAR AS first_ts,
           string_agg(DISTINCT run::VARCHAR, ',' ORDER BY run::VARCHAR) AS runs,
           string_agg(DISTINCT task_id, ',' ORDER BY task_id) AS tasks
    FROM read_parquet('${glob}', hive_partitioning = true, union_by_name = true)`);
  console.log(JSON.stringify(r.getRowObjectsJson()[0]));
})().catch((e) => { console.error(String(e)); process.exit(1); });
