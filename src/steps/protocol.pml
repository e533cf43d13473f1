/*
 * The steps mode's protocol, checked exhaustively by spin: see protocol.md beside it, and
 * .ci/model-check, which runs it.
 *
 * One client key (of one tenant and operation). Its handler runs two steps:
 *   seq 0: a local step ("create the order"),
 *   seq 1: a foreign step ("charge the card") at a provider, called with the step key,
 * then finishes with the response "order paid with <the charge>".
 *
 * Actors: two client requests (owners 1 and 2), the completer (owner 3), an operator, time.
 * Each database transaction is one atomic block; a call's effect at the provider is one
 * atomic event.
 *
 * Variants (cpp: `spin -DNAME -a protocol.pml`):
 *   TODAY_STEP_KEY    the step key leaves out the run id: the same in every life of the key
 *   TODAY_RESOLVE     resolve acts on any status (a running key too) and keeps the generation
 *   TODAY_FENCE       the lease check compares the generation only, not the run id
 *   TODAY_STATUS_GEN  marking a key in doubt or dead keeps its generation
 *   NO_DEDUP          the provider takes money on every call (no deduplication by key)
 *   TODAY_PURGE       a purge deletes expired running progress even with a foreign step
 *   LATE_CALLS        a call may reach the provider after its caller's lease has passed
 *   POLICY=ASK, POLICY=CALL_AGAIN   the foreign step's policy (default LEAVE_IN_DOUBT)
 *   OFF_I1 .. OFF_I5  switch an invariant off (to see what else a variant breaks)
 *   MAXLIVES, REQS, CLAIMS, MAXATT, OPS   the bounds below
 */

#ifndef MAXLIVES
#define MAXLIVES 2      /* lives of the key: run ids handed out */
#endif
#ifndef REQS
#define REQS 2          /* requests of each client owner */
#endif
#ifndef CLAIMS
#define CLAIMS 2        /* the completer's claims */
#endif
#ifndef MAXATT
#define MAXATT 1        /* the completer's max attempts */
#endif
#ifndef OPS
#define OPS 2           /* the operator's actions */
#endif
#define MAXCH 6         /* the provider's charges (a bound of the model, asserted) */

#define LEAVE_IN_DOUBT 1
#define ASK 2
#define CALL_AGAIN 3
#ifndef POLICY
#define POLICY LEAVE_IN_DOUBT
#endif

#define RUNNING 1
#define IN_DOUBT 2
#define DEAD 3

#define NONE 0
#define LIVE 1
#define EXPIRED 2

#define INTENT 1        /* st1: 0 none, 1 the intent, 1 + c the result "charge c" */

/* The invariants' names. Each assertion reads `In || ...`, so that pan's message
 * "assertion violated (I2 || ...)" names it; OFF_In sets In to 1, switching it off. */
#ifdef OFF_I1
bit I1 = 1;
#else
bit I1 = 0;
#endif
#ifdef OFF_I2
bit I2 = 1;
#else
bit I2 = 0;
#endif
#ifdef OFF_I3
bit I3 = 1;
#else
bit I3 = 0;
#endif
#ifdef OFF_I4
bit I4 = 1;
#else
bit I4 = 0;
#endif
#ifdef OFF_I5
bit I5 = 1;
#else
bit I5 = 0;
#endif

/* idempotency_progress: the key's row */
bool p_exists;
byte p_status;      /* RUNNING, IN_DOUBT, DEAD */
byte p_gen;         /* generation */
byte p_owner;       /* lease_owner: 0 is NULL, else the owner's id */
bool p_live;        /* lease_until is still ahead */
byte p_by;          /* the owner whose lease_until the row holds; 0: it was set to now */
byte p_att;         /* attempts (the completer's) */
byte p_run;         /* run_id: 1, 2, ... never reused. The life of the key is its run. */

/* idempotency_steps */
byte st0;           /* the local step: 0 none, 1 saved */
byte st1;           /* the foreign step: 0 none, INTENT, or 1 + c: its result, charge c */

/* idempotency_records */
byte rec;           /* NONE, LIVE, EXPIRED */

/* the provider: charge c was taken with the key ch_key[c] by a call of life ch_life[c] */
byte ncharges;
byte ch_key[MAXCH + 1];
byte ch_life[MAXCH + 1];

/* ghosts, per life */
byte lives;                     /* run ids handed out */
byte calls[MAXLIVES + 1];       /* calls that reached the provider */
byte taken[MAXLIVES + 1];       /* charges taken */
bool finished[MAXLIVES + 1];    /* its record was saved */
bool purged[MAXLIVES + 1];      /* its progress was purged */
byte writes[MAXLIVES + 1];      /* the local step's business writes */
/* owner i is between its intent's commit and its call, and its own lease_until has not
 * passed: the call may still reach the provider (it is cut off when the lease ends) */
bool budget[4];
byte ops;                       /* the operator's actions */

#ifdef TODAY_STEP_KEY
#define STEP_KEY(run) 1         /* hash(tenant, operation, key, step) */
#else
#define STEP_KEY(run) (run)     /* hash(run_id, tenant, operation, key, step) */
#endif

#ifdef LATE_CALLS
#define MAY_CALL true           /* a stalled call may reach the provider at any time */
#else
#define MAY_CALL budget[me]
#endif

/* The store's lease check (check_lease; release likewise): the claim's generation and run
 * id are the key's, and it is running. */
#ifdef TODAY_FENCE
#define SAME_LEASE (p_exists && p_gen == mygen)
#else
#define SAME_LEASE (p_exists && p_run == myrun && p_gen == mygen)
#endif
#define LEASE_OK (SAME_LEASE && p_status == RUNNING)

/* I4: whoever commits is the key's current owner: its life, its generation, running. */
#define CURRENT (p_run == myrun && p_gen == mygen && p_status == RUNNING)

/* A commit under the lease: its check passed, the lease is moved to now + lease. */
inline extend() {
  assert(I4 || CURRENT);
  p_live = true; p_by = me
}

/* The lease ends now (release, set_status, resolve, dead letter). */
inline end_lease() {
  p_owner = 0; p_live = false; p_by = 0
}

inline drop_progress() {
  p_exists = false; p_status = 0; p_gen = 0; p_owner = 0; p_live = false; p_by = 0;
  p_att = 0; p_run = 0; st0 = 0; st1 = 0
}

/* The charge the provider took with `key`, if any (0: none). */
inline lookup(key, out) {
  out = 0; k = 1;
  do
  :: k > ncharges -> break
  :: k <= ncharges && ch_key[k] == key -> out = k; break
  :: else -> k++
  od;
  k = 0
}

/* A call of life `life` reaches the provider with `key`: `out` is the charge it answers. */
inline provider_call(key, life, out) {
  calls[life]++;
  /* I2: no second call of the step in a life (unless its policy is CallAgain) */
  assert(I2 || POLICY == CALL_AGAIN || calls[life] <= 1);
#ifdef NO_DEDUP
  out = 0;
#else
  lookup(key, out);
#endif
  if
  :: out == 0 ->
     assert(ncharges < MAXCH);
     ncharges++; ch_key[ncharges] = key; ch_life[ncharges] = life; taken[life]++;
     out = ncharges;
     /* I1: money taken == orders paid: a life takes one charge */
     assert(I1 || taken[life] <= 1);
     printf("MSC: owner %d: calls the provider (life %d, step key %d): new charge %d\n",
            me, life, key, out)
  :: else ->
     printf("MSC: owner %d: calls the provider (life %d, step key %d): charge %d again\n",
            me, life, key, out)
  fi
}

#define END_REQUEST mygen = 0; myrun = 0; s0 = 0; s1 = 0; v = 0; goto request

/* A client's request (completer false: owners 1 and 2) or the completer (owner 3). */
proctype Owner(byte me; bool completer)
{
  byte n;                 /* requests (claims) made */
  byte mygen, myrun;      /* the lease: generation and run id */
  byte s0, s1;            /* the steps the claim read back */
  byte v;                 /* the charge in hand */
  byte k;                 /* scratch */

request:
  /* StepProtocol::acquire */
  if
  :: !completer ->
     atomic {
       if
       :: n == REQS -> goto stop
       :: else -> n++
       fi;
       if
       :: !p_exists && rec == LIVE ->
          printf("MSC: owner %d: acquire: Completed (the record is replayed)\n", me);
          goto request
       :: !p_exists && rec != LIVE && lives == MAXLIVES -> goto stop  /* the bound of lives */
       :: !p_exists && rec != LIVE && lives < MAXLIVES ->
          /* a new life: generation 1, a new run id, leftover steps deleted */
          lives++;
          p_exists = true; p_status = RUNNING; p_gen = 1; p_owner = me; p_live = true;
          p_by = me; p_att = 0; p_run = lives; st0 = 0; st1 = 0;
          mygen = 1; myrun = p_run; s0 = 0; s1 = 0;
          printf("MSC: owner %d: acquire: new life %d, generation 1\n", me, myrun)
       :: p_exists && p_status == IN_DOUBT ->
          printf("MSC: owner %d: acquire: InDoubt\n", me);
          goto request
       :: p_exists && p_status != IN_DOUBT && p_owner != 0 && p_live ->
          printf("MSC: owner %d: acquire: Held\n", me);
          goto request
       :: p_exists && p_status != IN_DOUBT && !(p_owner != 0 && p_live) ->
          /* taken over (a dead key too, for a client): the steps read back */
          p_gen++; p_status = RUNNING; p_owner = me; p_live = true; p_by = me;
          mygen = p_gen; myrun = p_run; s0 = st0; s1 = st1;
          printf("MSC: owner %d: acquire: takes life %d over, generation %d\n",
                 me, myrun, mygen)
       fi
     }
  :: completer ->
end_idle:
     atomic {
       /* Completer::run_once: an idle running key (its lease has passed), claimed */
       n < CLAIMS && p_exists && p_status == RUNNING && !(p_owner != 0 && p_live) ->
       n++;
       if
       :: p_att >= MAXATT ->
          p_status = DEAD;
#ifndef TODAY_STATUS_GEN
          p_gen++;
#endif
          end_lease();
          printf("MSC: completer: out of attempts, life %d is dead\n", p_run);
          goto request
       :: else ->
          p_att++; p_gen++; p_owner = me; p_live = true; p_by = me;
          mygen = p_gen; myrun = p_run; s0 = st0; s1 = st1;
          printf("MSC: completer: claims life %d, generation %d\n", myrun, mygen)
       fi
     }
  fi;

  /* The handler. Steps::local -> StepProtocol::run_local: the business write and the step's
   * row, in one transaction. */
  if
  :: s0 == 1 -> skip                                    /* saved: not run again */
  :: else ->
     atomic {
       if
       :: LEASE_OK && st0 == 0 ->
          extend();
          writes[p_run]++;
          /* I3: the local step writes once in a life */
          assert(I3 || writes[p_run] == 1);
          st0 = 1;
          printf("MSC: owner %d: local step committed (life %d)\n", me, p_run)
       :: LEASE_OK && st0 != 0 -> goto release          /* StepsChanged: rolled back */
       :: LEASE_OK ->                                   /* the work failed: rolled back */
          printf("MSC: owner %d: local step failed, rolled back\n", me);
          goto release
       :: !LEASE_OK ->
          printf("MSC: owner %d: local step: LeaseLost\n", me);
          END_REQUEST
       fi
     }
  fi;

  /* Steps::foreign */
  if
  :: s1 > INTENT -> v = s1 - 1; goto finish            /* its saved result */
  :: s1 == INTENT ->
     /* an intent without a result: the step's policy */
#if POLICY == LEAVE_IN_DOUBT
     atomic {
       /* set_status(in_doubt) under the lease */
       if
       :: LEASE_OK ->
          assert(I4 || CURRENT);
          p_status = IN_DOUBT;
#ifndef TODAY_STATUS_GEN
          p_gen++;
#endif
          end_lease();
          printf("MSC: owner %d: life %d left in doubt\n", me, p_run);
          END_REQUEST                                  /* not released */
       :: else -> END_REQUEST
       fi
     }
#elif POLICY == ASK
     atomic {
       /* the provider is asked what happened with the step key */
       lookup(STEP_KEY(myrun), v);
       if
       :: v != 0 ->
          printf("MSC: owner %d: asks the provider: charge %d\n", me, v);
          goto save_result
       :: else ->
          printf("MSC: owner %d: asks the provider: no charge, calls again\n", me)
       fi
     }
#else
     skip                                               /* CallAgain */
#endif
  :: s1 == 0 -> skip
  fi;

  /* save_step: the intent commits before the call (one saved before is left as it is) */
  atomic {
    if
    :: LEASE_OK && st1 <= INTENT ->
       extend(); st1 = INTENT; budget[me] = true;
       printf("MSC: owner %d: intent committed (life %d)\n", me, p_run)
    :: LEASE_OK && st1 > INTENT -> goto release         /* StepsChanged */
    :: !LEASE_OK ->
       printf("MSC: owner %d: intent: LeaseLost\n", me);
       END_REQUEST
    fi
  }
  /* The call, with the step key. It reaches the provider, if it does, while its caller's
   * own lease has not passed: it is cut off before the lease ends. */
  if
  :: atomic {
       MAY_CALL -> provider_call(STEP_KEY(myrun), myrun, v); budget[me] = false
     };
     if
     :: goto save_result                                /* the answer arrives */
     :: atomic {
          printf("MSC: owner %d: the answer is lost (unknown)\n", me);
          v = 0; goto release
        }
     fi
  :: atomic {
       printf("MSC: owner %d: the call never reached the provider (unknown)\n", me);
       budget[me] = false; goto release
     }
  :: atomic {
       /* Unavailable: the provider said it did nothing with this call; forget_intent, only
        * when the intent is this request's own (an intent found from an earlier attempt may
        * stand for a call that did take money: it stays) */
       budget[me] = false;
       if
       :: LEASE_OK ->
          extend();
          if
          :: st1 == INTENT && s1 == 0 -> st1 = 0;
             printf("MSC: owner %d: provider unavailable, intent forgotten\n", me)
          :: else ->
             printf("MSC: owner %d: provider unavailable, the earlier intent stays\n", me)
          fi;
          goto release
       :: else -> END_REQUEST
       fi
     }
  fi;

save_result:
  /* save_step with the result: a saved result is never overwritten */
  atomic {
    if
    :: LEASE_OK && st1 <= INTENT ->
       extend(); st1 = 1 + v;
       printf("MSC: owner %d: result committed: charge %d (life %d)\n", me, v, p_run)
    :: LEASE_OK && st1 > INTENT -> goto release         /* StepsChanged */
    :: !LEASE_OK ->
       printf("MSC: owner %d: result: LeaseLost\n", me);
       END_REQUEST
    fi
  }

finish:
  /* StepProtocol::finish: the record saved, the steps and progress deleted */
  atomic {
    if
    :: LEASE_OK && rec == LIVE -> goto release          /* Corrupt: a live record */
    :: LEASE_OK && rec != LIVE ->
       assert(I4 || CURRENT);
       printf("MSC: owner %d: finish: life %d's order paid with charge %d (of life %d)\n",
              me, p_run, v, ch_life[v]);
       /* I1: the order is paid by a charge its own life took */
       assert(I1 || ch_life[v] == p_run);
       /* I3: the response is what the steps saved */
       assert(I3 || (st1 == 1 + v && st0 == 1));
       rec = LIVE; finished[p_run] = true;
       drop_progress();
       END_REQUEST
    :: !LEASE_OK ->
       printf("MSC: owner %d: finish: LeaseLost\n", me);
       END_REQUEST
    fi
  }

release:
  /* StepProtocol::release under the generation: the row locked, then the steps read */
  atomic {
    if
    :: SAME_LEASE && p_status == RUNNING && st0 == 0 && st1 == 0 ->
       assert(I4 || CURRENT);
       printf("MSC: owner %d: release: no steps, progress deleted\n", me);
       drop_progress();
       END_REQUEST
    :: SAME_LEASE && !(p_status == RUNNING && st0 == 0 && st1 == 0) ->
       assert(I4 || CURRENT);
       printf("MSC: owner %d: release: the lease ends\n", me);
       end_lease();
       END_REQUEST
    :: else ->
       printf("MSC: owner %d: release: LeaseLost\n", me);
       END_REQUEST
    fi
  }

stop:
  skip
}

/* An operator (admin): delete the record, resolve the key, purge. */
active proctype Operator()
{
  byte k, c;
end:
  do
  :: atomic {
       /* delete: the next request with the key runs afresh */
       ops < OPS && rec != NONE -> rec = NONE; ops++;
       printf("MSC: operator: deletes the record\n")
     }
  :: atomic {
       /* StepStore::resolve, as the provider says: --done with the charge taken with the
        * step key, else --call-again */
#ifdef TODAY_RESOLVE
       ops < OPS && p_exists ->
#else
       ops < OPS && p_exists && (p_status == IN_DOUBT || p_status == DEAD) ->
       p_gen++;
#endif
       if
       :: st1 == INTENT ->
          lookup(STEP_KEY(p_run), c);
          if
          :: c != 0 -> st1 = 1 + c;
             printf("MSC: operator: resolve --done (charge %d), life %d\n", c, p_run)
          :: else -> st1 = 0;
             printf("MSC: operator: resolve --call-again, life %d\n", p_run)
          fi;
          c = 0
       :: else ->
          printf("MSC: operator: resolve, life %d\n", p_run)
       fi;
       p_status = RUNNING; p_att = 0; end_lease(); ops++
     }
  :: atomic {
       /* purge: expired records */
       ops < OPS && rec == EXPIRED -> rec = NONE; ops++;
       printf("MSC: operator: purge deletes the expired record\n")
     }
  :: atomic {
       /* purge (StepStore::purge_progress): expired records, and running progress past its
        * own expiry whose lease has ended (the expiry is time's: it may have passed whenever
        * purge runs). Without a foreign step it is deleted; with one (money may have been
        * taken) it becomes a dead letter, under a new generation. */
       ops < OPS && p_exists && p_status == RUNNING && !p_live ->
       if :: rec == EXPIRED -> rec = NONE :: else -> skip fi;
#ifndef TODAY_PURGE
       if
       :: st1 != 0 ->
          printf("MSC: operator: purge makes life %d a dead letter\n", p_run);
          p_status = DEAD; p_gen++; end_lease()
       :: else ->
#endif
          printf("MSC: operator: purge deletes life %d's progress\n", p_run);
          purged[p_run] = true; drop_progress()
#ifndef TODAY_PURGE
       fi;
#endif
       ops++
     }
  od
}

/* Time: the key's lease passes, an owner's own lease passes, the record expires. */
active proctype Time()
{
end:
  do
  :: atomic {
       p_live -> p_live = false; budget[p_by] = false; p_by = 0;
       printf("MSC: time: the lease of life %d passes\n", p_run)
     }
  :: atomic { budget[1] && p_by != 1 -> budget[1] = false }
  :: atomic { budget[2] && p_by != 2 -> budget[2] = false }
  :: atomic { budget[3] && p_by != 3 -> budget[3] = false }
  :: atomic { rec == LIVE -> rec = EXPIRED; printf("MSC: time: the record expires\n") }
  od
}

/* I5: a life that took money has its order saved, or its progress is still there (running,
 * in doubt or dead): never lost progress with a paid charge and no order, whatever an
 * operator or a purge did. */
#define LOST(L) (taken[L] > 0 && !finished[L] && !(p_exists && p_run == L))
#if MAXLIVES >= 3
#define ANY_LOST (LOST(1) || LOST(2) || LOST(3))
#else
#define ANY_LOST (LOST(1) || LOST(2))
#endif

active proctype Monitor()
{
end:
  atomic { ANY_LOST -> assert(I5 || !ANY_LOST) }
}

init
{
  atomic {
    run Owner(1, false);
    run Owner(2, false);
    run Owner(3, true)
  }
}
