# vhca-agent.ps1: the resident agent of a vhca Windows image (started at every boot by the scheduled task
# "vhca-agent", as SYSTEM). It speaks the protocol the Linux guest's resident agent speaks on its console:
#   agent  -> runner: VHCA-AGENT-READY
#   runner -> agent:  {"params": ["vhca.scenario=smoke", "vhca.verifier=0x0", ...]}
#   agent  -> runner: the scenario tool's output, ending in one VHCA-RESULT {json} line
# then powers the guest off (QEMU runs with -no-reboot, so that ends the run).
# A request with vhca.setup=verifier sets a boot state instead: Driver Verifier on with vhca.verifier's flags (or
# reset for 0x0), then power off; the next boot of that state runs with those settings.
#
# NEVER RUN: the machines this project is developed on have no Windows image. The runner's side of the protocol is
# tested; this side is checked only for the protocol words it shares with the runner (runner/tests/windows_guest.rs).
#
# The scenario tool: vhca-scenario.exe in the driver package (C:\vhca\driver), taking the request's words as
# arguments and printing VHCA-RESULT lines. It belongs to the Windows driver's package; when it is missing the agent
# reports that as the run's result instead of passing.

$ErrorActionPreference = 'Continue'
$com = New-Object System.IO.Ports.SerialPort 'COM1', 115200
$com.NewLine = "`n"
$com.ReadTimeout = -1
$com.Open()
function Say($line) { $com.WriteLine($line); Add-Content -Path 'C:\vhca\agent.log' -Value $line }
function Result($ok, $err) {
  $o = @{ ok = $ok }
  if ($err) { $o.error = $err }
  Say ("VHCA-RESULT " + ($o | ConvertTo-Json -Compress))
}
function Off { $com.Close(); shutdown /s /t 0; exit 0 }

Say 'VHCA-AGENT-READY'
$line = $com.ReadLine()
try { $request = $line | ConvertFrom-Json } catch { Result $false "agent: request is not JSON: $line"; Off }
$params = @{}
foreach ($w in $request.params) { $k, $v = $w -split '=', 2; $params[$k] = $v }
Say "VHCA-AGENT request $($request.params -join ' ')"

if ($params['vhca.setup'] -eq 'verifier') {
  $flags = [Convert]::ToUInt32(($params['vhca.verifier'] -replace '^0x', ''), 16)
  if ($flags -eq 0) { $cmd = 'verifier /reset' } else { $cmd = "verifier /flags 0x$('{0:x}' -f $flags) /driver vhca.sys" }
  Say "VHCA-SETUP step 1: $cmd"
  $out = cmd /c "$cmd 2>&1"
  $rc = $LASTEXITCODE
  $out | ForEach-Object { Say "  $_" }
  # verifier returns 2 ("reboot required") when it changed the settings.
  if ($rc -ne 0 -and $rc -ne 2) { Say "VHCA-SETUP-FAILED step 1 ($cmd): exit $rc" } else { Say 'VHCA-SETUP-DONE' }
  Off
}

# What Driver Verifier does in this boot, for the run's serial log.
cmd /c 'verifier /querysettings 2>&1' | ForEach-Object { Say "VHCA-VERIFIER $_" }
$tool = 'C:\vhca\driver\vhca-scenario.exe'
if (-not (Test-Path $tool)) {
  Result $false "agent: $tool is not in the driver package; the Windows guest cannot run scenarios without it"
  Off
}
& $tool @($request.params) 2>&1 | ForEach-Object { Say "$_" }
if ($LASTEXITCODE -ne 0) { Say "VHCA-AGENT vhca-scenario.exe exited with $LASTEXITCODE" }
Off
